"""The preflight: every input a run config names is checked before any work starts (and before a fresh start
removes the previous run's outputs) -- the engines' needs of this process, the pinned cores, the tracking
backends, the files, model folders, LoRA targets, functions, data sets and their lengths. `trainer.cli.load_run_config`
runs it for the command line; a RunConfig built in Python passes the same checks through `check_run_config`."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.backend.steps import TrainerConfig
from trainer.config import (
    DataConfig,
    EnginesConfig,
    RLTrainingConfig,
    RunConfig,
    SFTTrainingConfig,
)


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


def has_eval_sets(cfg: RunConfig) -> bool:
    """Whether the run evaluates: a [data].eval set or an [[eval.sets]] entry (the same answer on every rank)."""
    return cfg.data.eval is not None or bool(cfg.eval.sets)


def check_tracking(cfg: RunConfig) -> None:
    """The [logging] backends' packages are installed, and evaluation steps are weight-sync steps (an evaluation
    between syncs would score older weights, or need a sync of its own that changes what the engines generate)."""
    from trainer.tracking import check_backends

    check_backends(cfg.logging.backends)
    every, sync = cfg.eval.every, cfg.rl.sync_every
    if every and every % sync:
        raise ValueError(f"[eval] every = {every}: evaluation runs right after a weight sync, and [rl] sync_every = "
                         f"{sync}; make every a multiple of {sync}")


def check_cores(cfg: RunConfig) -> None:
    """Every core the config pins to ([trainer] cpus / rollout_cpus, an engine's cpus) is one this process may run
    on (a core that does not exist was an OSError traceback once the run had removed the previous one's outputs)."""
    have = sorted(os.sched_getaffinity(0))
    named = [("[trainer] cpus", cfg.trainer.cpus), ("[trainer] rollout_cpus", cfg.trainer.rollout_cpus),
             *((f"[engines] fleet[{i}] cpus", s.cpus) for i, s in enumerate(cfg.engines.fleet))]
    for key, cpus in named:
        gone = sorted(set(cpus or ()) - set(have))
        if gone:
            raise ValueError(f"{key} = {list(cpus)}: core(s) {gone} are not among this process's cores {have}")


def check_engines(engines: EnginesConfig, rl: RLTrainingConfig | None = None) -> None:
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


def check_inputs(cfg: RunConfig, mode: str, *, resume: bool = False) -> None:
    """The files, the model folders and the functions that `mode` will use exist and load; without `resume`, none
    of the files the config names lies in what the fresh start removes (trainer.run_folder)."""
    from trainer.data.buffer import data_specs
    from trainer.rewards.rules import load_reward_fn
    from trainer.run_folder import check_inputs_kept, input_paths, starts_over

    if cfg.trainer.backend == "tinker" and mode != "rl":
        raise ValueError(f"[trainer] backend = \"tinker\" runs the RL loop on a Tinker-API server: mode {mode!r} "
                         f"needs this process's trainer; run `rl`, or set [trainer] backend = \"local\"")
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
                raise FileNotFoundError(f"[data].{key}: {spec.path!r}: {_missing(spec.path)}")
    rollout, rolls_out = cfg.rl.rollout, mode != "sft"  # rl, sft+rl, demo and generate generate rollouts
    if rolls_out or has_eval_sets(cfg):  # evaluation runs the same episodes as the rollouts
        check_rollout_functions(rollout, filters=rolls_out)
    # RL rollouts score with [data].reward unless [rewards] sources are given; evaluation always does. An env or a
    # rollout_fn may return each episode's reward instead, in training and in evaluation alike (an episode that gets
    # a reward from neither is FAILED: trainer.rewards.rules.no_reward). The tool environment never gives one.
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
        from trainer.rewards.sources import check_reward_sources

        check_reward_sources(cfg.rewards, default_rule=data.reward, dynamic_filters=rollout.dynamic_filters)
    for s in cfg.eval.sets:  # [[eval.sets]]: their files and rewards ([data]'s when unset)
        for spec in data_specs(s.path, s.mapping(data), where=f"[[eval.sets]] {s.name!r}"):
            if not Path(spec.path).exists():
                raise FileNotFoundError(f"[[eval.sets]] {s.name!r}: {spec.path!r}: {_missing(spec.path)}")
        if (s.reward or data.reward) is not None:
            load_reward_fn(s.reward or data.reward)
        elif not own:
            raise ValueError(f"[[eval.sets]] {s.name!r}: no reward; set its reward or [data].reward{alternative}")
    _check_data(cfg, mode)


def _missing(path: str) -> str:
    """The end of the error for a file or folder the config names that is not there. A relative path is read from
    the current directory, not the config's: the error names that directory, which is what a run started elsewhere
    gets wrong."""
    where = "" if Path(path).is_absolute() else f" in {Path.cwd()} (relative paths are read from there)"
    return f"no such file or folder{where}"


def _check_model_inputs(cfg: RunConfig, mode: str) -> None:
    """The model folder, the checkpoint the run starts from and the critic's folder that `mode` loads are there, as
    their loaders will want them (without reading a weight)."""
    from engines.tokenizer import check_tokenizer_files
    from trainer.backend.export import check_checkpoint_exists
    from trainer.backend.models import check_model_folder

    if cfg.model.path is not None and not Path(cfg.model.path).exists():
        raise FileNotFoundError(f"[model].path = {cfg.model.path}: {_missing(cfg.model.path)}")
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
        try:  # what trainer.backend.critic.build_critic's load refuses
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


def check_rollout_functions(rollout: Any, *, filters: bool) -> None:
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
    from trainer.data.buffer import data_specs, load_mixture

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
    the phase that reads it (trainer.data.lengths says what is an error and what a warning)."""
    from trainer.data.lengths import check_prompt_lengths, check_sft_lengths, prompt_lengths, sft_lengths
    from trainer.data.sft_examples import sft_examples

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


def check_run_config(cfg: RunConfig, mode: str | None = None, *, resume: bool = False) -> None:
    """The checks a RunConfig passes beyond its own classes' (which config_from_dict ran): the step functions'
    configs, what [engines] needs of this process, the pinned cores, the tracking backends, and (given `mode`)
    every input that mode reads. The CLI's load_run_config and a config built in Python go through this one
    function; a problem is a ValueError / FileNotFoundError naming the key and the fix."""
    phase_configs(cfg)  # the step functions' own checks (token_budget >= micro_batch_buckets)
    check_engines(cfg.engines, cfg.rl)
    check_cores(cfg)
    check_tracking(cfg)
    if mode is not None:
        check_inputs(cfg, mode, resume=resume)
