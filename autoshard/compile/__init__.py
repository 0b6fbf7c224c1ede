"""Compile: capture a model, run the passes, and hold the per-rank programs (ShardedProgram, RankProgram, the simulator)."""
