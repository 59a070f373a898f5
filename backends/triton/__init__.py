"""Triton kernels for the indexer. Importing this package does not import triton: the plugin must
register (and say why it cannot run) on machines without it."""
