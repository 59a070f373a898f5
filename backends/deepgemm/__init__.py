"""DeepGEMM's fp8 MQA logits kernels as dispatch backends: adapter.py wraps deep_gemm (imported only
when a backend is probed, prepared or run), plugin.py registers the backends and probes availability."""
