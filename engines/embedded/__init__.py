"""The embedded inference engine: a real HTTP server speaking SGLang's native protocol (see server.py).

Start one with `python -m engines.embedded --model tiny --port 30000`; drive it with engines.sglang.SGLangEngine.
"""

from engines.embedded.presets import build_tiny_model, load_engine_model

__all__ = ["build_tiny_model", "load_engine_model"]
