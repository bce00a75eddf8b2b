"""Inference engines (embedded, SGLang, vLLM) and disk-free weight sync."""
