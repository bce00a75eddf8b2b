"""What a run writes in its output folder, and what a fresh start (a run without --resume) removes of it first.

    <output_dir>/
      config.toml          the resolved config              rewritten by every run, right after the fresh start
      summary.json         the finished run's figures       removed: until this run ends it would describe the last
      init_model/          the preset's folder              removed: a run reuses the one it finds, so a changed seed
                                                            or preset size would train the previous run's weights
      start_model/         [model] checkpoint, exported     removed: every run writes it again, over whatever the
                                                            previous run's export left there
      sft/, rl/            a phase's checkpoints, metrics.jsonl and rollouts/     removed for each phase the mode runs:
      sft.png, rl.png      a phase's plot                                         --resume would continue the old
      tensorboard/<phase>  a phase's TensorBoard events                           steps, the logs would mix
      wandb/               the W&B runs                     kept: each run is a W&B run of its own (nothing mixes),
                                                            and an offline one not yet synced exists only there
      export/              `export`'s HF folder             kept: written by export, not by a phase; a next run
                                                            may start from it ([model] path)
      rollouts/, replay/   `generate`'s and `replay`'s      kept: the debug modes' own (replay reads rollouts/)

A phase the mode does not run keeps its files: an `rl` run after an `sft` run keeps sft/, which its [model]
checkpoint may name. No file the config names for the run to read may lie in what the fresh start removes:
`check_inputs_kept` refuses that before anything is removed (it would be deleted before it is read).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.config import RunConfig

# The phases each training mode runs: the modes whose run starts over without --resume (export, generate and replay
# remove nothing).
PHASES = {"sft": ("sft",), "rl": ("rl",), "sft+rl": ("sft", "rl"), "demo": ("sft", "rl")}


def starts_over(mode: str, *, resume: bool) -> bool:
    """Whether `mode` removes the previous run's outputs before it starts (fresh_start)."""
    return mode in PHASES and not resume


def fresh_start_paths(out: Path, mode: str) -> list[Path]:
    """Every path under `out` that the fresh start of `mode` removes, present or not (module docstring: why each)."""
    paths = []
    for phase in PHASES[mode]:
        paths += [out / phase, out / f"{phase}.png", out / "tensorboard" / phase]
    return [*paths, out / "summary.json", out / "init_model", out / "start_model"]


def fresh_start(out: Path, mode: str) -> list[Path]:
    """Remove what the previous run of `mode`'s phases left in `out` (fresh_start_paths) and say what went; returns
    the removed paths. A symlink is removed, never what it points to."""
    old = [p for p in fresh_start_paths(out, mode) if p.exists() or p.is_symlink()]
    names = ", ".join(str(p.relative_to(out)) + ("/" if p.is_dir() and not p.is_symlink() else "") for p in old)
    for path in old:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if old:
        print(f"starting over in {out}: removed the previous run's {names} (pass --resume to continue a run instead)",
              flush=True)
    return old


def check_inputs_kept(out: Path, mode: str, inputs: Iterable[tuple[str, str]]) -> None:
    """ValueError naming the first input, as (config key, path), that lies in what the fresh start of `mode` removes
    from `out`: the run would delete it before reading it. Paths are compared resolved (relative to the working
    directory, symlinks followed), as the run opens them."""
    removed = [(p, p.resolve()) for p in fresh_start_paths(out, mode)]
    for key, path in inputs:
        where = Path(path).resolve()
        hit = next((given for given, real in removed if where.is_relative_to(real)), None)
        if hit is not None:
            raise ValueError(f"{key} = {str(path)!r} lies in {hit}, which a run without --resume removes before it "
                             f"starts (it starts over in {out}); pass --resume to continue that run, copy it (or "
                             f"`python -m trainer export` a checkpoint) to a folder outside {hit} first, or set "
                             f"output_dir to another folder")


def input_paths(cfg: RunConfig, *, data_keys: Iterable[str] = ("train", "sft", "eval")) -> list[tuple[str, str]]:
    """(config key, path) of every file and folder the config names for a run to read: the model, the checkpoint
    it starts from, the critic's and the reward sources' folders, key files, the [data] sets of `data_keys` (those
    the mode reads: another mode's set is checked by that mode), the [[eval.sets]], and the files of
    "path/to/file.py:name" functions (a rollout process imports them again after the fresh start). The rest is
    listed whether this mode reads it or not: a file the config names in the output folder's removed parts is a
    mistake either way."""
    from trainer.data.buffer import data_specs
    from trainer.rollout.loading import callable_file

    data, rollout = cfg.data, cfg.rl.rollout
    paths: list[tuple[str, Any]] = [("[model] path", cfg.model.path), ("[model] checkpoint", cfg.model.checkpoint)]
    if cfg.rl.critic is not None:
        paths.append(("[rl.critic] path", cfg.rl.critic.path))
    for i, c in enumerate(cfg.rewards.sources):
        paths += [(f"[rewards] sources[{i}] {k}", v) for k, v in c.files().items()]
    for key in data_keys:
        if getattr(data, key) is not None:
            paths += [(f"[data].{key}", s.path) for s in data_specs(getattr(data, key), data.mapping(),
                                                                    where=f"[data].{key}")]
    for e in cfg.eval.sets:
        paths += [(f"[[eval.sets]] {e.name!r} path", s.path)
                  for s in data_specs(e.path, e.mapping(data), where=f"[[eval.sets]] {e.name!r}")]
    functions = [("[data].reward", data.reward), ("[rl.rollout] env", rollout.env),
                 ("[rl.rollout] rollout_fn", rollout.rollout_fn), ("[rl.rollout] tool_parser", rollout.tool_parser),
                 ("[rl.rollout] agent", rollout.agent)]
    functions += [("[rl.rollout] tools", t) for t in rollout.tools]
    functions += [("[rl.rollout] dynamic_filters", f) for f in rollout.dynamic_filters]
    functions += [(f"[[eval.sets]] {e.name!r} reward", e.reward) for e in cfg.eval.sets]
    functions += [(f"[rewards] sources[{i}] {k}", v) for i, c in enumerate(cfg.rewards.sources)
                  for k, v in c.functions().items()]
    paths += [(key, callable_file(spec)) for key, spec in functions]
    return [(key, str(path)) for key, path in paths if path is not None]
