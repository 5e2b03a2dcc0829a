"""Runtime plumbing every strategy shares: messaging, nodes, partitions, sampling,
aggregation, checkpoints and capabilities."""
