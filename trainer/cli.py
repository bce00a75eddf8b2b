"""Command line: `python -m trainer {sft,rl,sft+rl,demo} --config configs/X.toml [--set key=value ...] [--resume]`.

A run config is one TOML file (see configs/demo.toml) read into one typed tree, trainer.config.RunConfig (every
key, its default and its help are declared there): [model] (a preset or a folder), [data] (prompt sets and the
reward function), [engines] (the fleet: `fleet = [{url, kind, tp_size, model}, ...]` with kind "sglang", "vllm",
"embedded" (without url: started by the run) or "local" (in this process); `in_process = true` is the shorthand for
one "local" engine; `sync` "group" (default) or "disk"; `master_address` / `master_port` of the
weight-update group), [sft] and [sft.optim], [rl], [rl.optim], [rl.loss] (kernels.PolicyLossConfig) and
[rl.rollout], [trainer] (backend settings: compile, logprob_chunk_tokens, ...) and [eval]. The run has one
temperature, [rl.rollout] temperature: the engines sample with it and the trainer's log-probs use it; and one
seed, the top-level `seed`: it reaches the SFT and RL trainers, the rollout sampling, the data order, the engines
and the preset's weights (an [sft] / [rl] / [rl.rollout] `seed` overrides it for that table and the ones in it).
[data].format is "chat" (prompts are user turns of the chat template) or "plain" (the prompt text itself, the
answer follows it directly): it applies to SFT, rollouts and evaluation alike. `--set rl.optim.lr=3e-4`
overrides any key (the value is parsed as TOML, so strings need quotes only when they would parse as something
else; one value for a list key is a one-element list). The whole config is validated before any work starts, and
every function it names is loaded then (before a fresh start removes a previous run's outputs); unknown keys are
errors that name the key, and a key that moved names its new table. A run without --resume starts over: it removes
what the previous run of its phases wrote (trainer.run_folder lists what goes and what stays), and a file the
config names inside that (a [model] checkpoint under rl/, say) is an error before anything is removed.
Configuration errors print `error: ...` and exit 2.

A run-time stop whose message says what to do (trainer.stops: every sample of a batch failed, a changed config on
resume, an engine that died, a damaged checkpoint) prints `error: ...` and exits 1, its traceback only with
RLKERNELS_DEBUG=1. Ctrl-C and SIGTERM (what Slurm, Kubernetes and torchrun send) write a checkpoint of the trained
steps, stop the engines the run started, say where to --resume from and exit 130 and 143.

Multi-GPU: launch with `torchrun --nproc-per-node N -m trainer rl --config ...`; rank 0 starts the embedded
engines (or talks to the given URLs) and every rank trains its FSDP2 shard.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
)
from trainer.config_reference import merge, override_value, parse_overrides  # noqa: F401  (callers import them here)
from trainer.data.sft_examples import sft_examples  # noqa: F401  (trainer.cli.sft_examples: where callers found it)
from trainer.evaluation import evaluate  # noqa: F401  (trainer.cli.evaluate: where callers have found it)
from trainer.preflight import (
    check_run_config,
    phase_configs,  # noqa: F401  (trainer.cli.phase_configs: where callers have found it)
)
from trainer.run import (  # noqa: F401  (trainer.cli.<name>: where callers have found them)
    build_engines,
    engines_for,
    model_tokenizer,
    prepare_model_folder,
    run,
)
from trainer.stops import SIGINT_EXIT, SIGTERM_EXIT, RunStopped, debug_enabled, sigterm_as_interrupt

MODES = ("sft", "rl", "sft+rl", "demo", "export", "generate", "replay", "serve")


# ----------------------------------------------------------------------------------------------- config




def load_run_config(path: str | Path, overrides: Sequence[str] = (), mode: str | None = None, *,
                    resume: bool = False) -> RunConfig:
    """The TOML run config with --set overrides applied, as a trainer.config.RunConfig: parsed and validated
    there as a whole (every section's keys and values, the SFT / RL / loss / rollout configs, the engines). Here:
    the step functions' configs (phase_configs), what [engines] needs of this process, and (given `mode`) the
    files, model folders and functions that mode uses, and (without `resume`) that none of the files the config
    names lies in what the run's fresh start removes. Every problem is a ConfigError, raised before any work
    starts. `name` defaults to the file's stem."""
    path = Path(path)
    if not path.is_file():
        # A relative path is read from the current directory: name it, since `python -m trainer demo` run outside
        # the project's checkout looks for configs/demo.toml there.
        where = "" if path.is_absolute() else f" in {Path.cwd()}"
        raise ConfigError(f"--config {path}: no such file{where}; the project's configs/ holds examples (`make demo` "
                          f"runs configs/demo.toml from the checkout's root)")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    try:  # each --set key and value checked here, so that its errors name --set, not the file
        over = parse_overrides(overrides, convert=override_value)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    table = merge(raw, over)
    table.setdefault("name", path.stem)
    try:
        cfg = config_from_dict(RunConfig, table, "")
        check_run_config(cfg, mode, resume=resume)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{path}: {e}") from e
    return cfg


# ----------------------------------------------------------------------------------------------- model


# ----------------------------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------------------------- run


def debug_mode(mode: str, cfg: RunConfig, *, rollouts: str | None, checkpoint: str | None) -> int:
    """`generate`: [rl] num_steps rollout batches from the engines, written to <output_dir>/rollouts, no training.
    `replay`: train on written rollouts without any engine (trainer.replay)."""
    from trainer.backend.export import start_folder
    from trainer.replay import generate, replay

    model_folder = start_folder(cfg, prepare_model_folder(cfg))
    tokenizer = model_tokenizer(model_folder)
    if mode == "replay":
        folder = Path(rollouts) if rollouts else Path(cfg.rl.output_dir) / "rollouts"
        try:
            replay(cfg, model_folder, folder, checkpoint=checkpoint, tokenizer=tokenizer)
        except (ValueError, FileNotFoundError) as e:  # no rollouts, a bad file, a checkpoint of another run
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    rollout = cfg.rl.rollout
    with engines_for(cfg, model_folder, is_main=True) as fleet:
        engines = build_engines(fleet, model_folder, api_key=cfg.engines.api_key,
                                connect_timeout_s=rollout.connect_timeout_s, max_connections=rollout.max_concurrency,
                                request_timeout_s=rollout.request_timeout_s)
        generate(cfg, engines, tokenizer=tokenizer, folder=Path(cfg.output_dir) / "rollouts")
    return 0


STAGES = (("before SFT", "before_sft"), ("after SFT", "after_sft"), ("before RL", "before_rl"),
          ("after RL", "after_rl"))


def print_table(summary: dict[str, Any]) -> None:
    """The held-out figures of every evaluation the run made: accuracy (correct answers) and the mean reward."""
    rows = [(label, key) for label, key in STAGES if f"accuracy_{key}" in summary]
    if rows:
        print("\n| stage | held-out accuracy | mean reward |\n|---|---|---|")
    for label, key in rows:
        print(f"| {label} | {summary[f'accuracy_{key}'] * 100:.1f} % | {summary[f'reward_mean_{key}']:.3f} |")
    steps = ", ".join(f"{phase} steps: {summary[f'{phase}_steps']}" for phase in ("sft", "rl")
                      if f"{phase}_steps" in summary)
    print(f"\n{steps + ', ' if steps else ''}wall time: {summary['wall_seconds']:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__.split("\n")[0],
        epilog="Every config key, its type, default and meaning: docs/config.md (regenerate it with `python -m "
               "trainer.config_reference`). A run writes its resolved config to <output_dir>/config.toml.")
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--config", default=None, help="TOML run config (demo: configs/demo.toml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set rl.num_steps=20 (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    ap.add_argument("--checkpoint", default=None, help="export: a step folder or a phase's output_dir (default: "
                    "the newest checkpoint of <output_dir>/rl, else <output_dir>/sft)")
    ap.add_argument("--out", default=None, help="export: the HF folder to write (default <output_dir>/export)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="export: store the weights in this dtype (default: as trained)")
    ap.add_argument("--adapter", action="store_true", help="export of a LoRA checkpoint: a PEFT adapter folder at "
                    "--out, on its base written beside it as <out>-base (default: the merged model)")
    ap.add_argument("--rollouts", default=None, help="replay: the folder of step_N.jsonl files to train on (written "
                    "by [logging] rollouts_every or the generate mode; default <output_dir>/rl/rollouts)")
    args = ap.parse_args(argv)
    if args.mode == "serve":  # the Tinker API (trainer/serve/app.py): its own [serve] table, not a run
        if args.config is None:
            ap.error("serve: --config is required (a TOML file with a [serve] table)")
        from trainer.serve.app import main as serve_main

        return serve_main(args.config, args.overrides)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars of tiny folders: noise in a run's log
    config = args.config or ("configs/demo.toml" if args.mode == "demo" else None)
    if config is None:
        ap.error(f"{args.mode}: --config is required (e.g. configs/demo.toml)")
    try:
        cfg = load_run_config(config, args.overrides, mode=args.mode, resume=args.resume)
    except ConfigError as e:  # configuration errors only: any other failure keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.mode == "export":
        from trainer.backend.export import export_run

        try:
            folder = export_run(cfg, prepare_model_folder(cfg), checkpoint=args.checkpoint,
                                out=args.out, dtype=args.dtype, adapter=args.adapter)
        except (ValueError, FileNotFoundError) as e:  # no such checkpoint, or one of another architecture
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"exported {folder}", flush=True)
        return 0
    since = time.time()  # what checkpoint_note tells this session's checkpoints by
    with sigterm_as_interrupt() as terminated:
        try:
            if args.mode in ("generate", "replay"):
                return debug_mode(args.mode, cfg, rollouts=args.rollouts, checkpoint=args.checkpoint)
            summary = run(args.mode, cfg, resume=args.resume, checked=True)  # load_run_config ran the preflight
        except BaseException as e:  # noqa: BLE001 - a stop is reported; anything else is re-raised as it is
            return report_stop(e, trained_phases(args.mode, cfg), since=since, terminated=terminated.is_set())
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 reports
        print_table(summary)
    return 0


def trained_phases(mode: str, cfg: RunConfig) -> list[tuple[str, str]]:
    """(phase, output_dir) of each phase `mode` trains and checkpoints (none for export, generate, replay)."""
    phases = {"sft": ("sft",), "rl": ("rl",), "sft+rl": ("sft", "rl"), "demo": ("sft", "rl")}.get(mode, ())
    return [(phase, getattr(cfg, phase).output_dir) for phase in phases]


def run_stop(e: BaseException) -> BaseException | None:
    """`e` when it is a run-time stop (trainer.stops: a RunStopped, or one of the engines' errors, which name the
    engine and the way on, or a damaged checkpoint), the first stop in it when it is an exception group of stops
    only (trio's nurseries wrap what their tasks raise); None for anything else (a bug keeps its traceback)."""
    from engines.protocol import EngineError
    from engines.weight_sync.wire import WeightSyncError
    from trainer.backend.checkpoint import CorruptCheckpointError

    stops = (RunStopped, EngineError, WeightSyncError, CorruptCheckpointError)
    if isinstance(e, BaseExceptionGroup):
        found, others = e.split(stops)
        while isinstance(found, BaseExceptionGroup):
            found = found.exceptions[0]
        return found if others is None else None
    return e if isinstance(e, stops) else None


def report_stop(e: BaseException, phases: Sequence[tuple[str, str]], *, since: float, terminated: bool) -> int:
    """The exit status of a run that raised `e`, after one line on stderr: Ctrl-C (130) or SIGTERM (143) with the
    checkpoint to resume from (rank 0 says it, for every rank), a run-time stop as `error: <message>` (1). Anything
    else, and a stop with RLKERNELS_DEBUG=1, is re-raised with its traceback."""
    from trainer.backend.checkpoint import is_interrupt, stop_note

    if is_interrupt(e):
        if int(os.environ.get("RANK", "0")) == 0:
            print(stop_note(phases, since=since, terminated=terminated), file=sys.stderr, flush=True)
        return SIGTERM_EXIT if terminated else SIGINT_EXIT
    stop = run_stop(e)
    if stop is None or debug_enabled():
        raise e
    print(f"error: {stop}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())

