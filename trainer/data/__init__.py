"""Prompt data: the DataBuffer (buffer.py: loading, shuffling, epochs, resumable position) and length checks of
prompts against the model's context (lengths.py)."""
