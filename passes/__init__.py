"""Passes over torch.export graphs: sharding analysis, the per-rank rewrite, pipeline stages, fusion."""
