"""DeepGEMM's fp8 paged MQA logits kernels as dispatch backends (SM90 native and flatten, SM100 native).

deep_gemm is imported only when a backend is probed, prepared or run, so this package imports, registers
and explains on machines without it. library.py is the one import; api.py bridges the API generations in
the field; inputs.py checks what the extension would assert; masking.py writes the contract's -inf;
availability.py says why a backend cannot run; paged_logits.py is prepare and run; plugin.py registers.
"""
