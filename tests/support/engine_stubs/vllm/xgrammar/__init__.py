"""Stand-in for xgrammar, for the vLLM engine tests only (tests/engines/test_vllm_plugin_*.py put it on sys.path).

vLLM imports xgrammar at module level for structured output and tool parsing, which lie outside the
DSA indexer's import path; every name here is an inert placeholder class, so using one fails loudly."""


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__module__": __name__, "__doc__": "xgrammar stand-in: not usable"})
