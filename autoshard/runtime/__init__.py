"""Runtime: one process of a tp x pp x dp job: mesh and groups, the schedule executor, p2p, gradient sync, traces."""
