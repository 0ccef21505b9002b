"""What runs one rank's pipeline step, independent of Lightning: the engine, the action executor, stage copies, p2p transport, gradient sync, weight versions."""
