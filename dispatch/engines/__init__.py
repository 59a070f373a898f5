"""Engine plugins: dispatch inside serving engines (SGLang, vLLM), loaded through each engine's own plugin mechanism."""
