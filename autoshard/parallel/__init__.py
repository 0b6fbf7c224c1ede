"""Parallel: the collectives, each a small autograd function with its module, its simulated form and the spec the rewrite emits."""
