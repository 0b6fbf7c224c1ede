"""Hand-written Megatron-style parallel GPT: the baseline for autoshard's runtime benchmarks."""
