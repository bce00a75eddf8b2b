"""Weight sync, engine side: the wire format both sides share (wire.py) and the embedded engine's receiver
(receiver.py). The vLLM plugin's receiver: engines/vllm_ext/receiver.py; the trainer's sender: trainer/weight_sync.
"""
