"""dispatch's own CUDA top-k (`cuda.radix`), compiled at first use where nvcc and a CUDA GPU are present."""
