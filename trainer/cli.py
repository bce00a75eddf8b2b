"""Command line: `python -m trainer {sft,rl,sft+rl,demo} --config configs/X.toml [--set key=value ...] [--resume]`.

A run config is one TOML file (see configs/demo.toml) read into one typed tree, trainer.config.RunConfig (every
key, its default and its help are declared there): [model] (a preset or a folder), [data] (prompt sets and the
reward function), [engines] (the fleet: `fleet = [{url, kind, tp_size, model}, ...]` with kind "sglang", "vllm",
"embedded" (without url: started by the run) or "local" (in this process); the older `urls`, `embedded = N` and
`in_process = true` still work; `sync` "group" (default) or "disk"; `master_address` / `master_port` of the
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
import contextlib
import dataclasses
import json
import os
import sys
import time
import tomllib
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engines.protocol import InferenceEngine, InProcessEngine
from trainer.backend.steps import TrainerConfig
from trainer.config import (
    ConfigError,
    DataConfig,
    EnginesConfig,
    RLTrainingConfig,
    RunConfig,
    SFTTrainingConfig,
    config_from_dict,
)
from trainer.config_reference import override_value, to_toml
from trainer.evaluation import evaluate  # noqa: F401  (trainer.cli.evaluate: where callers have found it)
from trainer.run_folder import fresh_start
from trainer.stops import SIGINT_EXIT, SIGTERM_EXIT, RunStopped, debug_enabled, sigterm_as_interrupt

if TYPE_CHECKING:
    from trainer.weight_sync import WeightSync

MODES = ("sft", "rl", "sft+rl", "demo", "export", "generate", "replay", "serve")


# ----------------------------------------------------------------------------------------------- config
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


@dataclasses.dataclass(frozen=True)
class PhaseConfigs:
    """The configs each phase's step functions take, derived from a run config: TrainerConfig holds the phase
    config and the [trainer] BackendConfig by reference (nothing copied)."""

    sft: SFTTrainingConfig
    sft_trainer: TrainerConfig
    rl: RLTrainingConfig
    rl_trainer: TrainerConfig


def phase_configs(cfg: RunConfig) -> PhaseConfigs:
    """Each phase's config and its TrainerConfig (the phase and the [trainer] backend settings)."""
    return PhaseConfigs(sft=cfg.sft, sft_trainer=TrainerConfig(phase=cfg.sft, backend=cfg.trainer), rl=cfg.rl,
                        rl_trainer=TrainerConfig(phase=cfg.rl, backend=cfg.trainer))


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
        raise ConfigError(f"--config {path}: no such file (see configs/ for examples)")
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
        phase_configs(cfg)  # the step functions' own checks (token_budget >= micro_batch_buckets)
        _check_engines(cfg.engines, cfg.rl)
        _check_cores(cfg)
        _check_tracking(cfg)
        if mode is not None:
            _check_inputs(cfg, mode, resume=resume)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{path}: {e}") from e
    return cfg


def _check_tracking(cfg: RunConfig) -> None:
    """The [logging] backends' packages are installed, and evaluation steps are weight-sync steps (an evaluation
    between syncs would score older weights, or need a sync of its own that changes what the engines generate)."""
    from trainer.tracking import check_backends

    check_backends(cfg.logging.backends)
    every, sync = cfg.eval.every, cfg.rl.sync_every
    if every and every % sync:
        raise ValueError(f"[eval] every = {every}: evaluation runs right after a weight sync, and [rl] sync_every = "
                         f"{sync}; make every a multiple of {sync}")


def _check_cores(cfg: RunConfig) -> None:
    """Every core the config pins to ([trainer] cpus / rollout_cpus, an engine's cpus) is one this process may run
    on (a core that does not exist was an OSError traceback once the run had removed the previous one's outputs)."""
    have = sorted(os.sched_getaffinity(0))
    named = [("[trainer] cpus", cfg.trainer.cpus), ("[trainer] rollout_cpus", cfg.trainer.rollout_cpus),
             *((f"[engines] fleet[{i}] cpus", s.cpus) for i, s in enumerate(cfg.engines.fleet))]
    for key, cpus in named:
        gone = sorted(set(cpus or ()) - set(have))
        if gone:
            raise ValueError(f"{key} = {list(cpus)}: core(s) {gone} are not among this process's cores {have}")


def _check_engines(engines: EnginesConfig, rl: RLTrainingConfig | None = None) -> None:
    """What [engines] needs of this process (EnginesConfig checked the rest), and of the RL loop's engines: from
    what each kind declares in engines.registry.ENGINE_KINDS, never from its name."""
    from engines.registry import engine_kind, kinds_where

    unversioned = sorted({s.kind for s in engines.fleet if not engine_kind(s).reports_token_versions})
    if rl is not None and rl.update_in_flight and unversioned:
        able = ", ".join(kinds_where(lambda k: k.reports_token_versions))
        raise ValueError(f"[rl] update_in_flight = true needs engines that report which weights made which token "
                         f"(kinds {able}); the fleet has {unversioned}: set it to false (the sync then waits for the "
                         f"batch being generated)")
    in_process = sorted({s.kind for s in engines.fleet if engine_kind(s).in_process})
    if rl is not None and rl.rollout_worker == "process" and in_process:
        raise ValueError(f"[rl] rollout_worker = \"process\" reaches the engines from another process, and an "
                         f"engine of kind {in_process[0]!r} lives in this one ([engines] in_process = true is kind "
                         f"\"local\"): set in_process = false (embedded engines as servers), use engines at URLs, or "
                         f"rollout_worker = \"thread\"")
    if in_process and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"an engine of kind {in_process[0]!r} ([engines].in_process = true is kind \"local\") needs "
                         f"a single-process trainer (it lives in rank 0's process); under torchrun start embedded "
                         f"engines (in_process = false) or give URLs")


def _check_inputs(cfg: RunConfig, mode: str, *, resume: bool = False) -> None:
    """The files, the model folders and the functions that `mode` will use exist and load; without `resume`, none
    of the files the config names lies in what the fresh start removes (trainer.run_folder)."""
    from trainer.rollout.data import data_specs
    from trainer.rollout.rewards import load_reward_fn
    from trainer.run_folder import check_inputs_kept, input_paths, starts_over

    needs = ("eval", "train") if mode in ("rl", "generate") else ("eval", "sft", "train")  # [data] sets read
    if starts_over(mode, resume=resume):  # first: the other checks' errors would not say it would be deleted
        check_inputs_kept(Path(cfg.output_dir), mode, input_paths(cfg, data_keys=needs))
    _check_model_inputs(cfg, mode)
    if mode in ("export", "replay"):  # read a checkpoint / written rollouts, no data
        return
    data = cfg.data
    if data.train is None:
        raise ValueError("[data].train: give a prompt data set (JSON/JSONL/parquet file or save_to_disk folder)")
    for key in needs:
        if getattr(data, key) is None:
            continue
        for spec in data_specs(getattr(data, key), data.mapping(), where=f"[data].{key}"):
            if not Path(spec.path).exists():
                raise FileNotFoundError(f"[data].{key}: {spec.path!r}: no such file or folder")
    rollout, rolls_out = cfg.rl.rollout, mode != "sft"  # rl, sft+rl, demo and generate generate rollouts
    if rolls_out or has_eval_sets(cfg):  # evaluation runs the same episodes as the rollouts
        _check_rollout_functions(rollout, filters=rolls_out)
    # RL rollouts score with [data].reward unless [rewards] sources are given; evaluation always does. An env or a
    # rollout_fn may return each episode's reward instead, in training and in evaluation alike (an episode that gets
    # a reward from neither is FAILED: trainer.rollout.rewards.no_reward). The tool environment never gives one.
    sourced = mode in ("rl", "sft+rl", "demo") and bool(cfg.rewards.sources)
    own = bool(rollout.env or rollout.rollout_fn or rollout.agent)
    alternative = ("; or give [rl.rollout] env (or rollout_fn) that returns each episode's reward"
                   + (" ([rl.rollout] tools' episodes get none from the tool environment)" if rollout.tools else ""))
    if data.reward is not None:
        load_reward_fn(data.reward)
    elif ((rolls_out and not sourced) or data.eval is not None) and not own:
        raise ValueError(f"[data].reward: mode {mode!r} scores samples; name the reward function, e.g. reward = "
                         f"\"arithmetic\" or reward = \"my_package.rewards:score\"{alternative}")
    if sourced:
        from trainer.rollout.reward_sources import check_reward_sources

        check_reward_sources(cfg.rewards, default_rule=data.reward, dynamic_filters=rollout.dynamic_filters)
    for s in cfg.eval.sets:  # [[eval.sets]]: their files and rewards ([data]'s when unset)
        for spec in data_specs(s.path, s.mapping(data), where=f"[[eval.sets]] {s.name!r}"):
            if not Path(spec.path).exists():
                raise FileNotFoundError(f"[[eval.sets]] {s.name!r}: {spec.path!r}: no such file or folder")
        if (s.reward or data.reward) is not None:
            load_reward_fn(s.reward or data.reward)
        elif not own:
            raise ValueError(f"[[eval.sets]] {s.name!r}: no reward; set its reward or [data].reward{alternative}")
    _check_data(cfg, mode)


def _check_model_inputs(cfg: RunConfig, mode: str) -> None:
    """The model folder, the checkpoint the run starts from and the critic's folder that `mode` loads are there, as
    their loaders will want them (without reading a weight)."""
    from engines.tokenizer import check_tokenizer_files
    from trainer.backend.export import check_checkpoint_exists
    from trainer.backend.models import check_model_folder

    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"[model].path = {cfg.model.path}: not a Hugging Face model folder (no config.json)")
    if cfg.model.path is not None:
        try:
            check_tokenizer_files(cfg.model.path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"[model].path = {e}") from None
    if cfg.model.checkpoint and mode != "export":  # export reads --checkpoint, not [model] checkpoint
        try:
            check_checkpoint_exists(cfg.model.checkpoint)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"[model] {e}") from None
    _check_lora_targets(cfg, mode)
    critic = cfg.rl.critic
    if mode in ("rl", "sft+rl", "demo") and critic is not None and critic.path is not None:
        try:  # what trainer.critic.build_critic's load refuses
            check_model_folder(critic.path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"[rl.critic] path = {critic.path!r}: {e}") from None
        except (ValueError, OSError) as e:  # a config.json transformers cannot read, an architecture it cannot build
            raise ValueError(f"[rl.critic] path = {critic.path!r}: {e}") from None


def _check_lora_targets(cfg: RunConfig, mode: str) -> None:
    """[sft.lora] / [rl.lora] target_modules that the model's blocks lack are named (with the modules they have)
    before any work: the model is built from its config on the meta device, no weight read."""
    phases = [p for p, modes in ((cfg.sft, ("sft", "sft+rl", "demo")), (cfg.rl, ("rl", "sft+rl", "demo")))
              if mode in modes and p.lora is not None]
    if not phases:
        return
    from trainer.backend.models import check_lora_targets

    if cfg.model.path is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model.path)
    else:
        from engines.tiny import tiny_model_config

        config = tiny_model_config(cfg.model.arch, **cfg.model.preset_sizes())
    for phase in phases:
        check_lora_targets(config, phase.lora, f"{phase.TABLE}.lora")


def _check_rollout_functions(rollout: Any, *, filters: bool) -> None:
    """Every function [rl.rollout] names (env, tools, rollout_fn, agent, tool_parser, and with `filters` the dynamic
    filters) loads now, through the loaders the rollouts themselves use: a typo is a configuration error before the
    run's fresh start removes the previous run's outputs, not a traceback after it."""
    from trainer.rollout.episodes import build_driver
    from trainer.rollout.gateway import load_agent
    from trainer.rollout.samples import resolve_filters
    from trainer.rollout.tools import load_tool_parser

    build_driver(rollout)
    if rollout.agent:
        load_agent(rollout.agent)
    load_tool_parser(rollout.tool_parser)
    if filters:
        try:
            resolve_filters(rollout.dynamic_filters)
        except ValueError as e:  # its messages start at "dynamic_filters:"; the table is named here
            raise ValueError(f"[rl.rollout] {e}") from e


def data_roles(mode: str, data: DataConfig) -> dict[str, Any]:
    """The data sets `mode` reads, by the [data] key that gives each, in the order the run uses them: the SFT
    examples ("sft": [data].sft, else the train set), the RL prompts ("train") and the evaluation set ("eval")."""
    roles = {}
    if mode in ("sft", "sft+rl", "demo"):
        roles["sft"] = data.train if data.sft is None else data.sft
    if mode in ("rl", "sft+rl", "demo", "generate"):
        roles["train"] = data.train
    if data.eval is not None:
        roles["eval"] = data.eval
    return roles


def _check_data(cfg: RunConfig, mode: str) -> None:
    """Every data set `mode` reads loads and passes the loaders' checks now (an empty file, a missing or mistyped
    field, text that is not UTF-8, a row without an answer), before any engine starts: these used to surface after
    the engines started and an evaluation ran.

    Answers: SFT from prompt/answer pairs trains on them, so every row needs one. A set that has an answer field
    needs it in every row. An RL or evaluation set with no answer field at all is allowed, with a warning: whether
    the reward reads the answer cannot be known here (a judge, a length reward or an environment may not)."""
    from trainer.rollout.data import data_specs, load_mixture

    limits = _model_limits(cfg)
    for key, value in data_roles(mode, cfg.data).items():
        sets = load_mixture(data_specs(value, cfg.data.mapping(), where=f"[data].{key}"), require_answer=key == "sft")
        for s in sets:
            if not s.has_answers and s.spec.messages_key is None:
                warnings.warn(f"[data].{key}: {s.spec.path} has no {s.spec.answer_key or 'answer'!r} field: the "
                              f"reward gets answer = None for every prompt; map the answers' field with "
                              f"[data].answer_key = \"<field>\" if the reward reads them", stacklevel=2)
        _check_lengths(cfg, key, sets, *limits)



def _model_limits(cfg: RunConfig) -> tuple[Any, int | None]:
    """The tokenizer and the context length (max_position_embeddings; None where the config has none) of the
    model the run loads: [model].path's, or the preset's (the folder prepare_model_folder writes)."""
    if cfg.model.path is not None:
        from engines.tokenizer import load_tokenizer

        folder = Path(cfg.model.path)
        return load_tokenizer(folder), json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    from engines.tiny import build_tokenizer, tiny_model_config

    return build_tokenizer(), tiny_model_config(cfg.model.arch, **cfg.model.preset_sizes()).max_position_embeddings


def _check_lengths(cfg: RunConfig, key: str, sets: Sequence[Any], tokenizer: Any, context: int | None) -> None:
    """The lengths of the data set `key` ("sft", "train", "eval") against the model's context and the budgets of
    the phase that reads it (trainer.rollout.lengths says what is an error and what a warning)."""
    from trainer.rollout.lengths import check_prompt_lengths, check_sft_lengths, prompt_lengths, sft_lengths

    data, sft = cfg.data, cfg.sft
    if key == "sft":
        examples = [(f"{s.spec.path}: row {i}", e) for s in sets
                    for i, e in enumerate(sft_examples(list(s), tokenizer, data.format))]
        check_sft_lengths(sft_lengths(examples, tokenizer, max_length=sft.max_length), max_length=sft.max_length,
                          token_budget=sft.token_budget, context=context, plain=data.format == "plain")
        return
    rows = prompt_lengths(sets, tokenizer, chat=data.format == "chat")
    if key == "train":
        check_prompt_lengths(rows, data_key=key, context=context, max_new_tokens=cfg.rl.rollout.max_new_tokens,
                             new_tokens_key="[rl.rollout] max_new_tokens", token_budget=cfg.rl.token_budget)
    else:
        new_tokens_key = "[eval] max_new_tokens" if cfg.eval.max_new_tokens else "[rl.rollout] max_new_tokens"
        check_prompt_lengths(rows, data_key=key, context=context, new_tokens_key=new_tokens_key,
                             max_new_tokens=cfg.eval.max_new_tokens or cfg.rl.rollout.max_new_tokens)


# ----------------------------------------------------------------------------------------------- model
def prepare_model_folder(cfg: RunConfig) -> Path:
    """The HF folder both the trainer and the engines load: [model].path, or the preset written once (its weights
    from the run's seed, with the project tokenizer the preset is built for)."""
    m = cfg.model
    if m.path is not None:
        folder = Path(m.path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"[model].path = {folder}: not a Hugging Face model folder (no config.json)")
        return folder
    from engines.embedded.presets import build_tiny_model
    from engines.tiny import build_tokenizer

    folder = Path(cfg.output_dir) / "init_model"
    if not (folder / "model.safetensors").is_file():
        model = build_tiny_model(cfg.seed, arch=m.arch, **m.preset_sizes())
        model.save_pretrained(folder, safe_serialization=True)
        build_tokenizer().save_pretrained(folder)
    return folder


def model_tokenizer(folder: Path) -> Any:
    """The model folder's own tokenizer: prompts, stop tokens and pad ids all come from it (never a stand-in); a
    folder without tokenizer files is refused, naming them."""
    from engines.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def trainer_ranks_here(environ: Mapping[str, str]) -> int:
    """How many trainer ranks run on this host, so on this host's GPUs: torchrun's LOCAL_WORLD_SIZE. WORLD_SIZE
    counts every node's ranks (on two nodes of 8 GPUs it is 16, and no GPU would look free); it stands in only
    for a launcher that sets no LOCAL_WORLD_SIZE, where an over-count makes placement refuse, never share a GPU."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = environ.get(name)
        if value is None:
            continue
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"environment variable {name}={value!r} is not a rank count (an int >= 1); launch with "
                              f"torchrun, which sets it, or unset it for one process")
        return int(value)
    return 1


def engine_devices(given: Sequence[str | None], *, trainer_device: str, local_world_size: int,
                   cuda_count: int) -> list[str]:
    """Where each engine the run starts runs: its fleet entry's `device` when set; else the CPU without CUDA; a
    one-process run's engines share the trainer's GPU (colocated: the weight sync goes through shared memory); a
    multi-process run's (torchrun) go, round robin, to the GPUs this host's ranks leave free (its ranks take cuda:0
    .. cuda:local_world_size-1, by LOCAL_RANK), because an engine beside rank 0 would take memory and compute from
    one rank only and stall the others. No free GPU is an error naming the fix."""
    if cuda_count == 0:
        return [d or "cpu" for d in given]
    if local_world_size <= 1:
        return [d or trainer_device for d in given]
    free = [f"cuda:{i}" for i in range(local_world_size, cuda_count)]
    if not free and any(d is None for d in given):
        raise ConfigError(f"[engines]: {local_world_size} trainer ranks use every one of this host's {cuda_count} "
                          f"GPUs, and the engines the run starts would crowd rank 0's; run fewer ranks (torchrun "
                          f"--nproc-per-node {cuda_count - 1}) or place each engine with fleet = [{{kind = "
                          f"\"embedded\", device = \"cuda:N\"}}]")
    auto = iter(free * len(given))
    return [d or next(auto) for d in given]


def prefix_cache_tokens(cfg: RunConfig) -> int | None:
    """The embedded engines' prefix-cache budget: [engines] prefix_cache_tokens when set; else the engine's default
    for multi-turn rollouts ([rl.rollout] env, tools, rollout_fn or agent: each turn reuses the earlier turns' KV)
    and 0 (off) for single-turn ones, which never reuse a finished row's KV (keeping it costs ~60 us a row)."""
    r = cfg.rl.rollout
    if cfg.engines.prefix_cache_tokens is not None:
        return cfg.engines.prefix_cache_tokens
    return None if (r.env or r.tools or r.rollout_fn or r.agent) else 0


@contextlib.contextmanager
def engines_for(cfg: RunConfig, model_folder: Path, *, is_main: bool, device: str = "cpu"):
    """Yield the fleet ([engines].fleet, EngineSpecs) with every engine reachable: the entries of a launchable kind
    without a url ("embedded") are launched here as processes by their kind's `launch` (the spec gets the URL), an
    in-process kind's ("local") built here on `device`, the trainer's own (the entry becomes {"engine": <it>},
    which build_engines takes as is); what each kind can do is its engines.registry entry's. Rank 0 only, other
    ranks get the list from rank 0. On another device than the trainer's, a one-GPU run would generate in fp32 on
    the CPU and the weight sync would pick a transport the engine refuses.

    Each started engine requires an API key: [engines].api_key, else a random one made here (the spec carries it
    to build_engines; it reaches the engine in its environment, never its command line), so no other local user
    can swap its weights or pause it."""
    from engines.registry import engine_kind, launched_by_run

    e = cfg.engines
    fleet: list[Any] = list(e.fleet)
    to_start = [i for i, s in enumerate(fleet) if launched_by_run(s)]
    local = [i for i, s in enumerate(fleet) if engine_kind(s).in_process]
    if not (to_start or local) or not is_main:
        yield fleet
        return
    from engines.embedded.launch import new_api_key
    from engines.registry import LaunchOptions, build_engine, launch_engine, started_spec

    key = e.api_key or new_api_key()
    places = engine_devices([fleet[i].device for i in to_start], trainer_device=device,
                            local_world_size=trainer_ranks_here(os.environ),
                            cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    procs = [launch_engine(fleet[i], LaunchOptions(str(model_folder), api_key=key, seed=cfg.seed, threads=e.threads,
                                                   start_timeout_s=e.start_timeout_s, device=place,
                                                   prefix_cache_tokens=prefix_cache_tokens(cfg)))
             for i, place in zip(to_start, places)]
    started: list[InProcessEngine] = []
    try:
        for p in procs:
            p.launch()
        for i in local:
            started.append(build_engine(fleet[i], model_folder=model_folder, seed=cfg.seed, device=device,
                                        threads=e.threads, prefix_cache_tokens=prefix_cache_tokens(cfg)))
            fleet[i] = {"engine": started[-1]}
        for p in procs:
            p.wait_healthy()
        for i, p in zip(to_start, procs):  # started: the spec is now a server at a URL
            fleet[i] = started_spec(fleet[i], url=p.url, api_key=key)
        yield fleet
    finally:
        for eng in started:
            eng.close()
        for p in procs:
            p.kill()


def build_engines(fleet: Sequence[Any], model_folder: Path, *, api_key: str | None = None,
                  connect_timeout_s: float = 10.0, max_connections: int = 64) -> list[InferenceEngine]:
    """Engine objects for a fleet, each built by engines.registry.build_engine from its EngineSpec (a dict entry
    {url, kind, tp_size, model, api_key} is read as one). An entry that carries its started object under "engine" (the
    in-process engine engines_for started and owns) is that object."""
    from engines.registry import EngineSpec, build_engine

    out = []
    for t in fleet:
        if isinstance(t, dict) and t.get("engine") is not None:
            out.append(t["engine"])
            continue
        fields = [f.name for f in dataclasses.fields(EngineSpec)]
        spec = t if isinstance(t, EngineSpec) else EngineSpec(**{k: t[k] for k in fields if k in t})
        out.append(build_engine(spec, model_folder=model_folder, api_key=api_key,
                                connect_timeout_s=connect_timeout_s, max_connections=max_connections))
    return out


def build_sender(cfg: RunConfig, model: Any, engines: Sequence[InferenceEngine]) -> WeightSync:
    """The weight-sync sender [engines] asks for: the process group (default; master_address from the config, else
    this host's address the engines reach, 127.0.0.1 when all are local) or the disk fallback (logged)."""
    from trainer.weight_sync import DiskWeightSync, WeightSyncSender, default_master_address

    e = cfg.engines
    if e.sync == "disk":
        sender = DiskWeightSync(model, engines, folder=e.sync_folder)
        print(f"weight sync: disk fallback ([engines] sync = \"disk\"): every sync writes a safetensors folder "
              f"in a private folder under {sender.base} and each engine reloads it", flush=True)
        return sender
    address = e.master_address or default_master_address([eng.url for eng in engines])
    return WeightSyncSender(model, engines, master_address=address, master_port=e.master_port,
                            fallback_dtype=served_dtype(cfg, model))


def served_dtype(cfg: RunConfig, model: Any) -> torch.dtype:
    """The dtype engines that do not report theirs (a stock SGLang, vLLM) are sent: [engines] dtype, else the one
    the trainer computes in ([trainer] param_dtype: bfloat16 on CUDA, float32 on CPU), not its fp32 masters."""
    from trainer.backend.parallel import compute_dtype

    if cfg.engines.dtype is not None:
        return getattr(torch, cfg.engines.dtype)
    return compute_dtype(next(model.parameters()).device.type, cfg.trainer)


def pin_trainer(cfg: RunConfig) -> None:
    """[trainer] cpus: this process on those cores, one torch thread each (engines it starts later set their own
    cores: a child may leave its parent's)."""
    cpus = cfg.trainer.cpus
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


@contextlib.contextmanager
def cores_left_to_trainer(cfg: RunConfig):
    """On CPU, while embedded engines generate beside the trainer's steps on this host (async rollouts), give the
    trainer's intra-op (OpenMP) pool only the cores the engines leave free.

    An OpenMP region waits for its slowest thread: when an engine process wants a core that a trainer thread
    holds, every parallel region of the train step stalls. Measured on 2 busy cores with one engine thread, a GRPO
    train step took 20-51 s with 2 trainer threads and 1.1-1.2 s with 1. In synchronous mode the engines are idle
    while the trainer steps, so it keeps every core (on the quiet 2-core machine: 1.26-1.46 s train steps with 2
    threads vs 1.50-1.93 s with 1). Not applied on CUDA, with engines given by URL, or when OMP_NUM_THREADS is set
    (the user's choice wins)."""
    engine_cores = cfg.engines.started_here * cfg.engines.threads
    overlapped = cfg.rl.async_rollout
    if (torch.cuda.is_available() or engine_cores == 0 or not overlapped or "OMP_NUM_THREADS" in os.environ
            or cfg.trainer.cpus):  # pinned: the config placed every side
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - engine_cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- data
def sft_examples(prompts: Sequence[Any], tokenizer: Any, fmt: str) -> list[Any]:
    """SFT examples from prompt/answer records.

    chat: one-turn conversations (a record may carry full "messages" in its metadata instead), tokenized by
    trainer.sft with the assistant-only mask. plain: Samples `prompt + answer + eos`, the loss on answer + eos,
    exactly the token layout the rollouts of a plain-format run produce.
    """
    from trainer.rollout.samples import prompt_token_ids
    from trainer.types import Sample

    for i, p in enumerate(prompts):
        if p.answer is None and not p.metadata.get("messages"):
            raise ValueError(f"SFT example {i} ({p.prompt[:40]!r}) has no answer, and SFT trains on the answer (it "
                             f"would train on the text \"None\"); give it one or SFT on conversations")
    if fmt == "plain":
        out = []
        for p in prompts:
            prompt_ids = prompt_token_ids(tokenizer, p.prompt, chat=False)
            answer_ids = prompt_token_ids(tokenizer, str(p.answer), chat=False) + [tokenizer.eos_token_id]
            out.append(Sample(prompt=p.prompt, tokens=tuple(prompt_ids + answer_ids), response_length=len(answer_ids)))
        return out
    out = []
    for p in prompts:
        msgs = p.metadata.get("messages")
        out.append(list(msgs) if msgs else [{"role": "user", "content": p.prompt},
                                            {"role": "assistant", "content": str(p.answer)}])
    return out


# ----------------------------------------------------------------------------------------------- run
@dataclasses.dataclass(frozen=True)
class _Run:
    """What the phases of one CLI run share, built once in `run`."""

    mode: str
    cfg: RunConfig
    phases: PhaseConfigs
    model_folder: Path  # the HF folder the trainer and the engines load
    tokenizer: Any  # the model folder's own
    is_main: bool  # rank 0: starts the engines, evaluates, plots, writes the summary
    resume: bool
    summary: dict[str, Any]  # filled as the phases finish; written to <output_dir>/summary.json


def run(mode: str, cfg: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run `mode` end to end; returns the summary (also written to <output_dir>/summary.json on rank 0)."""
    from trainer.backend.export import start_folder
    from trainer.backend.steps import broadcast_from_rank0, init_distributed, mesh_device
    from trainer.evaluation import Evaluator, eval_sets

    t_start = time.time()
    out = Path(cfg.output_dir)
    pin_trainer(cfg)
    mesh = init_distributed()
    is_main = mesh.get_rank() == 0
    if is_main and mode in ("rl", "sft+rl", "demo") and cfg.rl.rollout_worker == "process":
        from trainer.rollout.process_worker import warm_up

        warm_up()  # its imports (~3 s) overlap the engines' start, the model's build and the first evaluation
    if is_main and not resume:  # what it removes, and why: trainer.run_folder
        fresh_start(out, mode)
    if is_main and not resume:  # a resume writes it once its checkpoint accepted this config (_logger)
        write_resolved_config(out, mode, cfg)
    model_folder = start_folder(cfg, prepare_model_folder(cfg)) if is_main else None
    model_folder = Path(broadcast_from_rank0(str(model_folder)))
    r = _Run(mode=mode, cfg=cfg, phases=phase_configs(cfg), model_folder=model_folder,
             tokenizer=model_tokenizer(model_folder), is_main=is_main, resume=resume,
             summary={"mode": mode, "config": cfg.name})
    rollout = r.phases.rl.rollout
    # SFT alone needs engines only to evaluate (before, during and after, like the other modes).
    needs_engines = mode != "sft" or has_eval_sets(cfg)
    engines_cm = (engines_for(cfg, model_folder, is_main=is_main, device=str(mesh_device(mesh.device_type)))
                  if needs_engines else contextlib.nullcontext([]))
    with engines_cm as fleet:
        fleet = broadcast_from_rank0(fleet)  # rank 0 started (or was given) the engines
        engines = build_engines(fleet, model_folder, api_key=cfg.engines.api_key,
                                connect_timeout_s=rollout.connect_timeout_s, max_connections=rollout.max_concurrency)
        sets = eval_sets(cfg, tokenizer=r.tokenizer) if is_main else []
        evaluator = Evaluator(sets, engines, cfg, tokenizer=r.tokenizer, rollout=rollout)
        sft_components, sender = None, None
        if mode in ("sft", "sft+rl", "demo"):
            sft_components, sender = _sft_phase(r, engines, evaluator)
        if mode in ("rl", "sft+rl", "demo"):
            _rl_phase(r, engines, sft_components, sender, evaluator)
        elif sender is not None:
            sender.close()
    r.summary.update(evaluator.summary())
    r.summary["wall_seconds"] = round(time.time() - t_start, 1)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(r.summary, indent=2) + "\n")
    return r.summary


def has_eval_sets(cfg: RunConfig) -> bool:
    """Whether the run evaluates: a [data].eval set or an [[eval.sets]] entry (the same answer on every rank)."""
    return cfg.data.eval is not None or bool(cfg.eval.sets)


def write_resolved_config(out: Path, mode: str, cfg: RunConfig) -> None:
    """<out>/config.toml: what this run ran, every key with defaults filled in (`--config` it to run it again)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(f"# the resolved config of `{mode}` (every key, defaults filled in)\n"
                                     + to_toml(cfg))


def _logger(r: _Run, phase: str, phase_dir: str) -> Callable[[int], Any]:
    """The phase's metrics logger, opened by the loop once it knows the step it starts after (resume). A resumed
    run writes its config.toml here, after the checkpoint accepted this config: a resume refused for a changed
    config (CheckpointMismatch) leaves the run's config.toml as it was."""
    from trainer.tracking import build_logger

    text = to_toml(r.cfg)

    def open_logger(keep_through: int) -> Any:
        if r.resume and r.is_main:
            write_resolved_config(Path(r.cfg.output_dir), r.mode, r.cfg)
        return build_logger(r.cfg.logging, phase=phase, phase_dir=Path(phase_dir), run_dir=Path(r.cfg.output_dir),
                            run_name=r.cfg.name, config_text=text, config=tomllib.loads(text), enabled=r.is_main,
                            keep_through=keep_through)

    return open_logger


def _sft_phase(r: _Run, engines: Sequence[InferenceEngine], evaluator: Any) -> tuple[Any, WeightSync | None]:
    """SFT from the model folder; returns the trained TrainingComponents (RL continues from them in memory) and the
    weight-sync sender to the engines (None without engines), which evaluation during SFT syncs through."""
    from trainer.backend.steps import build_components
    from trainer.evaluation import Evaluation
    from trainer.plot import plot_metrics
    from trainer.rollout.data import config_prompts, warn_unknown_characters
    from trainer.sft import run_sft_training

    data, scfg = r.cfg.data, r.phases.sft
    prompts = config_prompts(data.train if data.sft is None else data.sft, data.mapping(), where="[data].sft",
                             seed=r.cfg.seed, require_answer=True)
    if r.is_main:
        texts = [p.prompt for p in prompts] + [str(p.answer) for p in prompts if p.answer is not None]
        warn_unknown_characters(r.tokenizer, texts, where="[data].sft")
    components = build_components(str(r.model_folder), r.phases.sft_trainer)
    if r.phases.sft_trainer.lora is not None and r.is_main:  # what `export` merges the adapters into
        from trainer.backend.export import record_lora_base

        record_lora_base(scfg.output_dir, folder=r.model_folder)
    sender, evaluation = None, None
    if engines and has_eval_sets(r.cfg):
        sender = build_sender(r.cfg, components.model, engines)
        sender.init_group()
        then_rl = r.mode != "sft"  # RL's first evaluation is of the SFT weights: SFT does not repeat it

        def run_eval(step: int) -> dict[str, float]:
            if step > 0:
                sender.sync(weight_version=0)  # collective: every rank; the engines serve this SFT step's weights
            label = "before_sft" if step == 0 else "after_sft" if step == scfg.num_steps else None
            return evaluator("sft", step, label=label) if r.is_main else {}

        evaluation = Evaluation(every=r.cfg.eval.every, run=run_eval, at_end=not then_rl)
    components, state, hist = run_sft_training(
        None, sft_examples(prompts, r.tokenizer, data.format), scfg, tokenizer=r.tokenizer, resume=r.resume,
        trainer_config=r.phases.sft_trainer, components=components, evaluation=evaluation,
        logger=_logger(r, "sft", scfg.output_dir))
    r.summary.update(sft_steps=state.step, sft_final_loss=hist[-1]["loss"] if hist else None)
    if r.is_main:
        plot_metrics(Path(scfg.output_dir) / "metrics.jsonl", Path(r.cfg.output_dir) / "sft.png",
                     title=f"{r.cfg.name} SFT")
    return components, sender


def _rl_phase(r: _Run, engines: Sequence[InferenceEngine], sft_components: Any, sender: WeightSync | None,
              evaluator: Any) -> None:
    """GRPO from the SFT weights (in memory) or the model folder; the engines are synced to them first (the sender
    SFT used, when it had one: the same model)."""
    from trainer.backend.memory import release_phase_memory
    from trainer.backend.steps import build_components
    from trainer.evaluation import Evaluation
    from trainer.plot import plot_metrics
    from trainer.rl import run_rl_training
    from trainer.rollout.data import config_buffer, warn_unknown_characters
    from trainer.rollout.dumps import RolloutDumps

    data, rl_cfg, tcfg = r.cfg.data, r.phases.rl, r.phases.rl_trainer
    if sft_components is not None:  # SFT's AdamW state is not RL's: freed (and on CUDA returned) before RL builds
        release_phase_memory(sft_components)
    comp = build_components(sft_components.root if sft_components is not None else str(r.model_folder), tcfg)
    if tcfg.lora is not None and r.is_main:  # what `export` merges the adapters into: SFT's result, or the folder
        from trainer.backend.export import record_lora_base

        record_lora_base(rl_cfg.output_dir, **({"sft_dir": r.phases.sft.output_dir} if sft_components is not None
                                               else {"folder": r.model_folder}))
    rewards = _reward_sources(r, engines, device=str(comp.device))
    if sender is not None and comp.model is not sft_components.model:  # a copy: the policy gained a value head
        sender.close()
        sender = None
    if sender is None:
        sender = build_sender(r.cfg, comp.model, engines)
        sender.init_group()
    buffer = config_buffer(data.train, data.mapping(), where="[data].train", seed=r.cfg.seed)
    if r.is_main:
        warn_unknown_characters(r.tokenizer, [p.prompt for s in buffer.sets for p in s], where="[data].train")
    first = "after_sft" if sft_components is not None else "before_rl"

    def run_eval(step: int) -> dict[str, float]:  # after the loop's weight sync
        label = first if step == 0 else "after_rl" if step == rl_cfg.num_steps else None
        return evaluator("rl", step, label=label)

    evaluation = Evaluation(every=r.cfg.eval.every, run=run_eval) if evaluator else None
    dumps = RolloutDumps(every=r.cfg.logging.rollouts_every, folder=Path(rl_cfg.output_dir) / "rollouts",
                         table_rows=r.cfg.logging.table_rows)
    with cores_left_to_trainer(r.cfg):  # async: the engines generate while the trainer steps
        comp, state, hist = run_rl_training(None, buffer, rl_cfg, engines=engines, tokenizer=r.tokenizer,
                                            reward_fn=rewards, trainer_config=tcfg, components=comp,
                                            resume=r.resume, sender=sender,
                                            evaluation=evaluation, dumps=dumps if dumps.every else None,
                                            logger=_logger(r, "rl", rl_cfg.output_dir))
    sender.close()
    r.summary.update(rl_steps=state.step, rl_final_reward_mean=hist[-1]["reward_mean"] if hist else None)
    if r.is_main:
        plot_metrics(Path(rl_cfg.output_dir) / "metrics.jsonl", Path(r.cfg.output_dir) / "rl.png",
                     title=f"{r.cfg.name} {'PPO with a critic' if rl_cfg.critic is not None else 'GRPO'}")


def _reward_sources(r: _Run, engines: Sequence[InferenceEngine], *, device: str) -> Any:
    """The run's reward (trainer.rollout.reward_sources.RewardSources), built once: the [rewards] sources (reward
    models loaded on the trainer's `device`, judges on their engines), or without them [data].reward alone. Rank 0
    scores the rollouts; the other ranks never do, and build the [data].reward shorthand only."""
    from trainer.config import RewardsConfig
    from trainer.rollout.reward_sources import build_reward_sources, describe_rewards

    config = r.cfg.rewards if r.is_main else RewardsConfig()
    if config.sources:
        print(describe_rewards(config, r.cfg.data.reward), flush=True)
    # A rollout process scores the batches with sources of its own (its reward models loaded there): the trainer's
    # process loads none.
    in_child = r.cfg.rl.rollout_worker == "process"
    return build_reward_sources(config, default_rule=r.cfg.data.reward, engines=engines, tokenizer=r.tokenizer,
                                device=device, timeout_s=r.cfg.data.reward_timeout_s, load_models=not in_child)


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
                                connect_timeout_s=rollout.connect_timeout_s, max_connections=rollout.max_concurrency)
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

        return serve_main(args.config)
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
            summary = run(args.mode, cfg, resume=args.resume)
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

