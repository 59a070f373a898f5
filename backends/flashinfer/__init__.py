"""FlashInfer's lengths-aware radix top-k as a `topk` backend (an optional extra: `.[flashinfer]`)."""
