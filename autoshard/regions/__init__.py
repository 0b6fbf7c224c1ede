"""What the regions the passes outline run at step time: a `call_module` node per region, whose module
is built here (registry.py's REGION_MODULES, one row per kind): the experts call (experts_call.py,
expert parallelism's dispatch and combine), recomputation (recompute.py, torch.utils.checkpoint with
the rank's RNG states replayed) and size-only tables (tables.py, computed once per input sizes)."""
