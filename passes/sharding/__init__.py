"""Sharding analysis: per-op rules (a table), layouts, placements and the driver that annotates node.meta["sharding"]."""
