"""Resolve a user's "module:function" / "path/to/file.py:function" names: rewards, filters, environments, tools and
rollout functions are all named this way in a run file, and all load through `load_callable`."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any


def load_callable(spec: str | Callable[..., Any], what: str) -> Callable[..., Any]:
    """The callable `spec` names ("package.module:name" or "path/to/file.py:name"); a callable passes through.

    `what` names the config key in errors ("reward", "[rl.rollout] env", ...), so a bad name says where it came from.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r}: give 'package.module:name' or 'path/to/file.py:name'")
    mod_name, fn_name = spec.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            if not os.path.exists(mod_name):
                raise FileNotFoundError(f"{mod_name} does not exist")
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure becomes one clear message
        raise ValueError(f"{what} {spec!r}: cannot import {mod_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{what} {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def callable_file(spec: Any) -> str | None:
    """The file that load_callable imports for a "path/to/file.py:name" spec; None for a module name, a built-in
    name or a callable (nothing on disk the config names)."""
    if not isinstance(spec, str) or ":" not in spec:
        return None
    mod_name = spec.rsplit(":", 1)[0]
    return mod_name if mod_name.endswith(".py") else None
