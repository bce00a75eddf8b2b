"""Batching: samples -> packed micro-batches under a token budget (planner.py, micro_batches.py), and the
shared-prompt layout of a GRPO group (shared_prompt.py)."""
