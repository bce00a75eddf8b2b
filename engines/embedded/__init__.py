"""The embedded inference engine: a real HTTP server speaking SGLang's native protocol (see server.py).

Start one with `python -m engines.embedded --model tiny --port 30000`; drive it with engines.sglang.SGLangEngine.

The package itself imports nothing heavy: `python -m engines.embedded` checks its arguments (a refused --host, a
key file anyone can read) before torch and transformers load, and engines.embedded.launch (the trainer's side)
needs neither. The model builders load on first use.
"""

__all__ = ["build_tiny_model", "load_engine_model"]


def __getattr__(name: str):
    if name in __all__:
        from engines.embedded import presets

        return getattr(presets, name)
    raise AttributeError(f"module 'engines.embedded' has no attribute {name!r}")
