"""How a stage computes fast and is timed: compiled blocks, CUDA graphs, deferred weight gradients, action timing."""
