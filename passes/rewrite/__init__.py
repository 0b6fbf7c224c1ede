"""The rank rewrite: an annotated graph -> rank r's graph with its collectives (rank_rewrite.py),
and where gradients flow (grad_flow.py)."""
