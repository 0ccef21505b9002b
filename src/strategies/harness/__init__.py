"""Running ranks without Lightning: spawned gloo worlds, emulated compute for benchmarks, the NCCL replay and its recordings."""
