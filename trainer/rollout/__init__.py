"""Rollouts: the engine-driving manager (manager.py), episodes with environments and tools (episodes.py, tools.py),
agents through the OpenAI-compatible recording gateway (gateway.py, recording.py), the thread and process rollout
sources (source.py, process_worker.py), pure sample functions and filters (samples.py), dumps (dumps.py)."""
