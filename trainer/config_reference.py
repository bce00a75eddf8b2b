"""The config reference (docs/config.md) and a run's resolved config file, both from the config classes themselves.

Every key of a run file is a field of a dataclass in the `trainer.config.RunConfig` tree; its help is the comment
on the field's line (or the comment lines just above it). `reference()` walks the tree and renders one table per
TOML section; `python -m trainer.config_reference > docs/config.md` regenerates the page, and a test fails when
the page and the classes disagree (or a field has no help). `section_class(path)` resolves a dotted table name to
its class, for the CLI's check of `--set` keys (`check_key_path`). `to_toml(cfg)` writes a resolved RunConfig
back as a run file, every key filled in (what a run saves beside its outputs).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import math
import sys
import textwrap
import tokenize
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from engines.registry import EngineSpec
from kernels import PolicyLossConfig
from trainer.config import (
    MOVED,
    REWARD_SOURCE_CONFIGS,
    CriticConfig,
    EvalSetConfig,
    LoRAConfig,
    RewardSourceConfig,
    RLTrainingConfig,
    RunConfig,
    ServeModelConfig,
    SFTTrainingConfig,
    _hints,
    _section,
)

# Tables whose field is typed loosely (it also takes a ready-made object) but whose keys are another class's.
SUBTABLES: dict[tuple[type, str], type] = {(RLTrainingConfig, "loss"): PolicyLossConfig,
                                           (RLTrainingConfig, "critic"): CriticConfig,
                                           (SFTTrainingConfig, "lora"): LoRAConfig,
                                           (RLTrainingConfig, "lora"): LoRAConfig}
# Arrays of tables: [[engines.fleet]] entries are EngineSpecs, [[eval.sets]] entries EvalSetConfigs, [rewards]
# sources entries RewardSourceConfigs, [serve] models entries ServeModelConfigs.
ARRAY_TABLES: dict[str, type] = {"engines.fleet": EngineSpec, "eval.sets": EvalSetConfig,
                                 "rewards.sources": RewardSourceConfig, "serve.models": ServeModelConfig}
# Arrays whose entries' class is chosen by their `kind`: the shared keys' table, then one table per kind.
KINDED_TABLES: dict[str, dict[str, type]] = {"rewards.sources": REWARD_SOURCE_CONFIGS}


def section_class(cls: type, name: str) -> type | None:
    """The config class of field `name`'s sub-table in `cls`, or None when the field is a plain key."""
    return SUBTABLES.get((cls, name)) or _section(_hints(cls).get(name))


def _declaring(cls: type, name: str) -> type:
    """The class in `cls`'s MRO whose body declares field `name` (inherited fields are documented once, there)."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


@functools.cache
def _comments(owner: type) -> tuple[dict[str, int], dict[int, str], set[int]]:
    """({field: its line}, {line: its comment}, {lines that are only a comment}) of a class body, from its source
    (ast + tokenize: a "#" inside a string, or a docstring line that looks like a field, is neither)."""
    src = textwrap.dedent(inspect.getsource(owner))
    body = ast.parse(src).body[0].body
    lines = {n.target.id: n.lineno for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens}
    return lines, comments, {t.start[0] for t in tokens if t.line.strip().startswith("#")}


def field_help(cls: type, name: str) -> str:
    """The comment on field `name`'s line, or the comment lines right above it."""
    lines, comments, standalone = _comments(_declaring(cls, name))
    line = lines[name]
    if line in comments:
        return comments[line]
    above: list[str] = []
    while line - 1 - len(above) in standalone:
        above.insert(0, comments[line - 1 - len(above)])
    return " ".join(above)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(_default_scalar(v) for v in value) + "]"
    return _default_scalar(value)


def _default_scalar(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _type(cls: type, name: str) -> str:
    return str(_declaring(cls, name).__annotations__[name]).replace("|", "or")


def sections(cls: type = RunConfig, path: str = "") -> Iterator[tuple[str, type]]:
    """(dotted table name, class) for every table of the run file, depth first ("" is the top level)."""
    yield path, cls
    for f in dataclasses.fields(cls):
        sub = section_class(cls, f.name)
        name = f"{path}.{f.name}" if path else f.name
        if sub is not None:
            yield from sections(sub, name)
        elif name in ARRAY_TABLES:
            yield name, ARRAY_TABLES[name]
            for kind, kind_cls in KINDED_TABLES.get(name, {}).items():
                yield f'{name} kind = "{kind}"', kind_cls


def _table(path: str, cls: type) -> list[str]:
    array, _, kind = path.partition(" kind = ")
    title = "top level" if not path else (f"[[{array}]] with kind = {kind}" if kind else
                                          f"[[{path}]]" if path in ARRAY_TABLES else f"[{path}]")
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    out = [f"## {title}", "", f"`{cls.__module__}.{cls.__name__}`: {doc}", "", "| key | type | default | meaning |",
           "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or section_class(cls, f.name) is not None or f"{path}.{f.name}" in MOVED:
            continue
        if kind and _declaring(cls, f.name) is not cls:  # a shared key: documented in the [[array]] table
            continue
        out.append(f"| `{f.name}` | {_type(cls, f.name)} | `{_default(f)}` | "
                   f"{field_help(cls, f.name).replace('|', '/')} |")
    return out + [""]


def reference() -> str:
    """docs/config.md: every key of a run file, its type, default and meaning, one table per section."""
    head = ["# Config reference", "",
            "Generated from the config classes by `python -m trainer.config_reference > docs/config.md` (a test keeps "
            "it in sync). A run file (`configs/*.toml`) sets any of these keys; `--set section.key=value` overrides "
            "one from the command line. The top-level `seed` reaches every `seed` below unless a table sets its own; "
            "`[rl.loss] rollout_correction` defaults to \"tis\" when the rollouts are off-policy (`async_rollout`, "
            "or `sync_every` > 1) and to \"none\" otherwise.", ""]
    body = [line for path, cls in sections() for line in _table(path, cls)]
    return "\n".join(head + body)


if __name__ == "__main__":
    sys.stdout.write(reference())


# ----------------------------------------------------------------------------------------------- --set keys
def check_key_path(key: str) -> tuple[type, str] | None:
    """A dotted `--set` key names a key of the run file (a table is allowed: its value is an inline table), or a
    ConfigError says it came from --set, and what the table knows. Returns (the config class, the field) of a key,
    None for a table."""
    from trainer.config import MOVED, ConfigError

    cls, where = RunConfig, ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        path = f"{where}.{part}" if where else part
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if part not in names:
            table = f"[{where}]" if where else "the top level"
            if path in MOVED:
                raise ConfigError(f"--set {key}: {path} moved to {MOVED[path]}")
            raise ConfigError(f"--set {key}: unknown key {part!r} in {table} (from --set, not the config file); "
                              f"known: {sorted(names)}; docs/config.md lists every key")
        sub = section_class(cls, part)
        if sub is None:
            if i < len(parts) - 1:
                raise ConfigError(f"--set {key}: {path} is a key, not a table")
            return cls, part
        cls, where = sub, path
    return None


def override_value(key: str, value: Any) -> Any:
    """The value of `--set key=value` (already parsed as TOML) checked against the key's type before it meets the
    config file, so that an error names --set, not the file. A scalar where the key takes an array becomes a
    one-element array: `--set logging.backends=jsonl` or `rl.rollout.tools=mod:fn` (the shell ate any brackets and
    quotes; a string taken as its characters was never what was meant). Inline tables are checked when built."""
    from trainer.config import ConfigError, _is_tuple, check_value

    leaf = check_key_path(key)
    if leaf is None:
        return value
    hint = _hints(leaf[0])[leaf[1]]
    if _is_tuple(hint) and not isinstance(value, list):
        value = [value]
    try:
        check_value(hint, value, key)
    except ConfigError as e:
        raise ConfigError(f"--set {e} (the value given with --set, not the config file's)") from None
    return value


# ----------------------------------------------------------------------------------------------- resolved config
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, int | float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf") if v == v else "nan"
    if dataclasses.is_dataclass(v):
        v = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.init}
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to TOML")


def to_toml(cfg: Any, path: str = "") -> str:
    """A config (any node of the RunConfig tree) as the TOML of its run file, every key written: the file a run
    saves as <output_dir>/config.toml, which `--config` runs again. Unset keys are comments (TOML has no null)."""
    lines, tables = [], []
    for f in dataclasses.fields(cfg):
        name = f"{path}.{f.name}" if path else f.name
        if not f.init or name in MOVED:  # a moved key is written at its new place
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and name not in ARRAY_TABLES:
            tables.append(to_toml(value, name))
        elif value is None:
            lines.append(f"# {f.name} = (unset)")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    head = [f"[{path}]"] if path else []
    return "\n".join(head + lines) + "\n" + "".join("\n" + t for t in tables)


# ------------------------------------------------------------------ --set overrides (runs and `serve` alike)
def parse_overrides(pairs: Sequence[str], convert: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """["rl.lr=3e-4", "name=x"] -> nested dict; values parsed as TOML scalars/arrays, else kept as strings.
    `convert(key, value)`, when given, checks each value against its key and returns the value to use
    (trainer.config_reference.override_value)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r}: expected key=value, e.g. --set rl.lr=3e-4")
        key, raw = pair.split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        if convert is not None:
            value = convert(key.strip(), value)
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
