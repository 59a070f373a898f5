"""dispatch's vLLM plugin (vllm 0.33.0): the `vllm.general_plugins` entry point `dispatch`
(plugin.register), on only when VLLM_PLUGINS names it. Importing this package imports no vLLM;
docs/engines/vllm.md says what it replaces and how to check it is active."""
