"""Planning: the cost model, its formulas, GEMM timing, hardware presets and the planner that picks tp, pp, dp."""
