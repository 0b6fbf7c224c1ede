"""The rank rewrite: an annotated graph -> rank r's graph with its collectives."""
