"""The engine side: what a serving engine drives. IndexerStep (plan once per batch, select per layer),
CUDA-graph capture and replay, registry reload, rank agreement, and the engine plugins (sglang/, vllm/)."""
