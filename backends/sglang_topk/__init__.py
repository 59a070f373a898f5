"""SGLang's top-k kernels as backends of the `topk` op (plugin.py registers them)."""
