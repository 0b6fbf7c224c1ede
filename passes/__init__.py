"""Graph passes (installed as `autoshard.passes`): sharding analysis, then per-rank rewrite."""
