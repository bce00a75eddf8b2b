"""Command line: `python -m trainer {sft,rl,sft+rl,demo} --config configs/X.toml [--set key=value ...] [--resume]`.

A run config is one TOML file (see configs/demo.toml): [model] (a preset or a folder), [data] (JSONL prompt
files and the reward function), [engines] (the fleet: `fleet = [{url, kind, tp_size}, ...]` with kind "sglang",
"vllm" or "embedded", an embedded entry without url started by the run; the older `urls` / `embedded = N` still
work; `sync` "group" (default) or "disk"; `master_address` / `master_port` of the weight-update group), [sft] and
[sft.optim] (trainer.config.SFTTrainingConfig, OptimConfig), [rl], [rl.optim], [rl.loss]
(kernels.PolicyLossConfig) and [rl.rollout] (RLTrainingConfig, RolloutConfig), [eval], and [trainer] (backend
settings of trainer.backend.steps.TrainerConfig: compile, logprob_chunk_tokens, ...). The run has one temperature,
[rl.rollout] temperature: the engines sample with it and the trainer's log-probs use it.
[data].format is "chat" (prompts are user turns of the chat template) or "plain" (the prompt text itself, the
answer follows it directly): it applies to SFT, rollouts and evaluation alike. `--set rl.optim.lr=3e-4`
overrides any key (the value is parsed as TOML, so strings need quotes only when they would parse as something
else). The whole config is validated before any work starts; unknown keys are errors that name the key, and a
key that moved names its new table. Configuration errors print `error: ...` and exit 2.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio

from trainer.backend.steps import TrainerConfig
from trainer.config import RLTrainingConfig, SFTTrainingConfig, config_from_dict

MODES = ("sft", "rl", "sft+rl", "demo", "export")
TOP_KEYS = {"name", "output_dir", "seed", "model", "data", "engines", "sft", "rl", "eval", "trainer"}
MODEL_KEYS = {"preset", "path", "arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "checkpoint"}
# train / eval / sft: a data file (JSON, JSONL, parquet), a save_to_disk folder, or a list of {path, weight, ...}
# tables (a weighted mixture); the mapping keys apply to every set that does not set its own
# (trainer.rollout.data.DataSpec).
DATA_KEYS = {"train", "eval", "sft", "reward", "format", "prompt_key", "answer_key", "messages_key", "system_prompt",
             "split"}
FORMATS = ("chat", "plain")
ENGINE_KEYS = {"fleet", "urls", "embedded", "in_process", "api_key", "threads", "start_timeout_s", "sync",
               "sync_folder", "master_address", "master_port"}
# [engines].fleet: a list of {url, kind, tp_size, model} tables; an "embedded" entry without url is started here.
ENGINE_KINDS = ("sglang", "vllm", "embedded")
FLEET_KEYS = {"url", "kind", "tp_size", "model"}
SYNC_MODES = ("group", "disk")
EVAL_KEYS = {"max_new_tokens", "limit"}
DEFAULT_REWARD = "trainer.rollout.rewards:arithmetic_reward"


# ----------------------------------------------------------------------------------------------- config
def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """["rl.lr=3e-4", "name=x"] -> nested dict; values parsed as TOML scalars/arrays, else kept as strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r}: expected key=value, e.g. --set rl.lr=3e-4")
        key, raw = pair.split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
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


class ConfigError(ValueError):
    """The run config is invalid: the CLI prints the message and exits 2 (no traceback)."""


# [trainer] holds the backend settings of the step functions only; these TrainerConfig fields come from elsewhere.
TRAINER_KEYS = {"logprob_chunk_tokens", "compile", "compile_backend", "activation_checkpointing", "param_dtype",
                "share_prompts"}
_TRAINER_MOVED = {"temperature": "[rl.rollout] temperature (the trainer's log-probs use the rollout's)",
                  "policy_loss": "[rl.loss]", "lr": "[sft.optim] / [rl.optim] lr",
                  "eps": "[sft.optim] / [rl.optim] eps"}


@dataclasses.dataclass(frozen=True)
class PhaseConfigs:
    """The configs derived from a run config, built once when it is loaded (an absent [sft] / [rl]: defaults)."""

    sft: SFTTrainingConfig
    sft_trainer: TrainerConfig
    rl: RLTrainingConfig
    rl_trainer: TrainerConfig


def load_run_config(path: str | Path, overrides: Sequence[str] = (), mode: str | None = None) -> dict[str, Any]:
    """The TOML run config with --set overrides applied and validated as a whole: every section's keys, the SFT,
    RL, loss, rollout and trainer configs, the engines, and (given `mode`) the files and the reward function
    that mode uses. Every problem is a ConfigError, raised before any work starts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file (see configs/ for examples)")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    try:
        cfg = merge(raw, parse_overrides(overrides))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    for section, known in (("", TOP_KEYS), ("model", MODEL_KEYS), ("data", DATA_KEYS), ("engines", ENGINE_KEYS),
                           ("eval", EVAL_KEYS)):
        table = cfg if not section else cfg.get(section, {})
        unknown = sorted(set(table) - known)
        if unknown:
            where = f"[{section}]" if section else "top level"
            raise ConfigError(f"{path}: unknown config key(s) {unknown} at {where}; known: {sorted(known)}")
    fmt = cfg.get("data", {}).get("format", "chat")
    if fmt not in FORMATS:
        raise ConfigError(f"{path}: [data].format = {fmt!r}; choose one of {FORMATS}")
    cfg.setdefault("name", path.stem)
    cfg.setdefault("output_dir", f"runs/{cfg['name']}")
    cfg.setdefault("seed", 0)
    try:
        phase_configs(cfg)  # every derived config, so a bad key or value fails before any work starts
        _check_engines(cfg.get("engines", {}))
        if mode is not None:
            _check_inputs(cfg, mode)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{path}: {e}") from e
    return cfg


def sft_config(cfg: dict[str, Any]) -> SFTTrainingConfig:
    values = {"seed": cfg["seed"], **cfg.get("sft", {}), "output_dir": str(Path(cfg["output_dir"]) / "sft")}
    return config_from_dict(SFTTrainingConfig, values, "sft")


def rl_config(cfg: dict[str, Any]) -> RLTrainingConfig:
    values = {"seed": cfg["seed"], **cfg.get("rl", {}), "output_dir": str(Path(cfg["output_dir"]) / "rl")}
    chat = cfg.get("data", {}).get("format", "chat") == "chat"
    values["rollout"] = {**values.get("rollout", {}), "apply_chat_template": chat}
    return config_from_dict(RLTrainingConfig, values, "rl")


def trainer_overrides(cfg: dict[str, Any]) -> dict[str, Any]:
    """[trainer] keys: backend settings of the step functions (TRAINER_KEYS)."""
    over = dict(cfg.get("trainer", {}))
    for key in over:
        if key in _TRAINER_MOVED:
            raise ValueError(f"trainer.{key} moved to {_TRAINER_MOVED[key]}")
    unknown = sorted(set(over) - TRAINER_KEYS)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} in [trainer]; known: {sorted(TRAINER_KEYS)}")
    return over


def phase_configs(cfg: dict[str, Any]) -> PhaseConfigs:
    """The one place where a run config's derived configs are built: SFT and RL configs (the RL config resolves
    its loss), and the TrainerConfig of each phase."""
    from trainer.backend.steps import trainer_config_from

    over = trainer_overrides(cfg)
    sft, rl = sft_config(cfg), rl_config(cfg)
    return PhaseConfigs(sft=sft, sft_trainer=trainer_config_from(sft, **over), rl=rl,
                        rl_trainer=trainer_config_from(rl, **over))


def _check_fleet(fleet: Any) -> None:
    if not isinstance(fleet, list) or not all(isinstance(t, dict) for t in fleet):
        raise ValueError("[engines].fleet: give a list of tables, e.g. fleet = [{url = \"http://host:30000\", "
                         "kind = \"sglang\", tp_size = 2}, {kind = \"embedded\"}]")
    for i, t in enumerate(fleet):
        where = f"[engines].fleet[{i}]"
        unknown = sorted(set(t) - FLEET_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(FLEET_KEYS)}")
        kind = t.get("kind", "sglang")
        if kind not in ENGINE_KINDS:
            raise ValueError(f"{where}.kind = {kind!r}: choose one of {ENGINE_KINDS}")
        url = t.get("url")
        if url is None and kind != "embedded":
            raise ValueError(f"{where}: kind {kind!r} needs a url (only kind = \"embedded\" is started by the run)")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"{where}.url = {url!r}: give an http(s):// URL")
        tp = t.get("tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"{where}.tp_size = {tp!r}: the engine's tensor-parallel size, an int >= 1")
        if kind == "embedded" and tp != 1:
            raise ValueError(f"{where}: the embedded engine runs on one device; tp_size must be 1")


def _check_engines(e: dict[str, Any]) -> None:
    if not isinstance(e.get("in_process", False), bool):
        raise ValueError(f"[engines].in_process = {e['in_process']!r}: true (one engine inside the trainer's process, "
                         f"no HTTP) or false")
    if e.get("in_process"):
        given = [k for k in ("fleet", "urls") if e.get(k)] + (["embedded"] if e.get("embedded", 1) != 1 else [])
        if given:
            raise ValueError(f"[engines].in_process = true and [engines].{given[0]} both given: the in-process engine "
                             f"is the run's only engine (it replaces the embedded engine process); drop one of them")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("[engines].in_process = true needs a single-process trainer (it lives in rank 0's "
                             "process); under torchrun start embedded engines (in_process = false) or give URLs")
    if "fleet" in e:
        _check_fleet(e["fleet"])
        for old in ("urls", "embedded"):
            if e.get(old) not in (None, []):
                raise ValueError(f"[engines].{old} and [engines].fleet both given: list every engine in fleet "
                                 f"(a URL as {{url = \"...\", kind = \"sglang\"}}, a started one as "
                                 f"{{kind = \"embedded\"}})")
    sync = e.get("sync", "group")
    if sync not in SYNC_MODES:
        raise ValueError(f"[engines].sync = {sync!r}: choose 'group' (broadcast / shared memory) or 'disk'")
    port = e.get("master_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"[engines].master_port = {port!r}: a TCP port (0 = pick a free one)")
    if not isinstance(e.get("master_address", ""), str):
        raise ValueError("[engines].master_address: a host name or IP address (string) the engines can reach")
    urls = e.get("urls", [])
    if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                             for u in urls):
        raise ValueError(f"[engines].urls = {urls!r}: give a list of http(s):// URLs (or [] to start embedded ones); "
                         f"engines with a kind or tp_size go in [engines].fleet = [{{url, kind, tp_size}}, ...]")
    for key, minimum in (("embedded", 1), ("threads", 1), ("start_timeout_s", 1e-9)):
        v = e.get(key, minimum)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < minimum:
            raise ValueError(f"[engines].{key} = {v!r}: must be a number >= {minimum:g}")


def _check_inputs(cfg: dict[str, Any], mode: str) -> None:
    """The files, the model folder and the reward function that `mode` will use exist and load."""
    from trainer.rollout.data import data_specs
    from trainer.rollout.rewards import load_reward_fn

    model = cfg.get("model", {})
    if "path" in model and not (Path(model["path"]) / "config.json").is_file():
        raise FileNotFoundError(f"[model].path = {model['path']}: not a Hugging Face model folder (no config.json)")
    if model.get("preset", "tiny") != "tiny":
        raise ValueError(f"[model].preset = {model['preset']!r}: the only preset is 'tiny'; or set [model].path")
    if mode == "export":  # reads a checkpoint, no data
        return
    data = cfg.get("data", {})
    if "train" not in data:
        raise ValueError("[data].train: give a prompt data set (JSON/JSONL/parquet file or save_to_disk folder)")
    needs = {"train"} | ({"sft"} if mode != "rl" else set()) | {"eval"}
    for key in sorted(needs & set(data)):
        for spec in data_specs(data[key], data, where=f"[data].{key}"):
            if not Path(spec.path).exists():
                raise FileNotFoundError(f"[data].{key}: {spec.path!r}: no such file or folder")
    if mode != "sft" or data.get("eval"):
        load_reward_fn(data.get("reward", DEFAULT_REWARD))


# ----------------------------------------------------------------------------------------------- model
def prepare_model_folder(cfg: dict[str, Any], tokenizer: Any) -> Path:
    """The HF folder both the trainer and the engines load: [model].path, or a preset written once (seeded)."""
    m = cfg.get("model", {})
    if "path" in m:
        folder = Path(m["path"])
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"[model].path = {folder}: not a Hugging Face model folder (no config.json)")
        return folder
    if m.get("preset", "tiny") != "tiny":
        raise ValueError(f"[model].preset = {m['preset']!r}: the only preset is 'tiny'; or set [model].path")
    from engines.embedded.presets import build_tiny_model

    folder = Path(cfg["output_dir"]) / "init_model"
    if not (folder / "model.safetensors").is_file():
        sizes = {k: v for k, v in m.items() if k in MODEL_KEYS - {"preset", "path", "arch"}}
        model = build_tiny_model(cfg["seed"], arch=m.get("arch", "llama"), **sizes)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return folder


def fresh_start(out: Path, mode: str) -> None:
    """A run without --resume starts over: the previous outputs of the phases this mode runs would otherwise mix
    into this run's (metrics.jsonl is appended to; resume logic would see old checkpoints)."""
    import shutil

    phases = {"sft": ("sft",), "rl": ("rl",)}.get(mode, ("sft", "rl"))
    old = [out / part for part in phases if (out / part).exists()]
    for path in old:
        shutil.rmtree(path)
    if old:
        print(f"starting over in {out}: removed the previous run's {', '.join(p.name for p in old)} outputs "
              f"(pass --resume to continue a run instead)", flush=True)


def fleet_of(e: dict[str, Any]) -> list[dict[str, Any]]:
    """[engines] as a list of {url (None: started here), kind, tp_size, model} tables: `fleet` as given, else the
    older forms (`urls`: SGLang-protocol servers; `in_process`: one engines.local.LocalEngine, kind "local"; none
    of them: `embedded` engine processes started here, 1 by default)."""
    if "fleet" in e:
        return [{"url": t.get("url"), "kind": t.get("kind", "sglang"), "tp_size": int(t.get("tp_size", 1)),
                 "model": t.get("model")} for t in e["fleet"]]
    if e.get("urls"):
        return [{"url": u, "kind": "sglang", "tp_size": 1, "model": None} for u in e["urls"]]
    if e.get("in_process"):
        return [{"url": None, "kind": "local", "tp_size": 1, "model": None}]
    return [{"url": None, "kind": "embedded", "tp_size": 1, "model": None} for _ in range(int(e.get("embedded", 1)))]


@contextlib.contextmanager
def engines_for(cfg: dict[str, Any], model_folder: Path, *, is_main: bool):
    """Yield the fleet (fleet_of) with every URL filled in: the embedded entries without a URL are started here
    as processes, a "local" entry as an in-process engine (its object under "engine"); rank 0 only, other ranks
    get the list from rank 0."""
    e = cfg.get("engines", {})
    fleet = fleet_of(e)
    to_start = [i for i, t in enumerate(fleet) if t["url"] is None and t["kind"] == "embedded"]
    local = [i for i, t in enumerate(fleet) if t["kind"] == "local"]
    if not (to_start or local) or not is_main:
        yield fleet
        return
    from engines.embedded.launch import EngineProcess
    from engines.local import LocalEngine

    procs = [EngineProcess(str(model_folder), api_key=e.get("api_key") or None, seed=cfg["seed"],
                           threads=e.get("threads", 1), start_timeout_s=e.get("start_timeout_s", 180.0))
             for _ in to_start]
    started: list[Any] = []
    try:
        for p in procs:
            p.launch()
        for i in local:
            started.append(LocalEngine(str(model_folder), seed=cfg["seed"]))
            fleet[i] = {**fleet[i], "url": started[-1].url, "engine": started[-1]}
        for p in procs:
            p.wait_healthy()
        for i, p in zip(to_start, procs):
            fleet[i] = {**fleet[i], "url": p.url}
        yield fleet
    finally:
        for eng in started:
            eng.close()
        for p in procs:
            p.kill()


def build_engines(fleet: Sequence[dict[str, Any]], model_folder: Path, *, api_key: str | None = None,
                  connect_timeout_s: float = 10.0, max_connections: int = 64) -> list[Any]:
    """Engine objects for a fleet: SGLang-protocol clients for "sglang" and "embedded" (with the configured
    tp_size), VLLMEngine for "vllm" (its served model name: the entry's `model`, else the model folder)."""
    from engines.sglang import SGLangEngine
    from engines.vllm import VLLMEngine

    out = []
    for t in fleet:
        if t["kind"] == "local":
            out.append(t["engine"])
        elif t["kind"] == "vllm":
            out.append(VLLMEngine(t["url"], t.get("model") or str(model_folder), api_key=api_key))
        else:
            out.append(SGLangEngine(t["url"], api_key=api_key, tp_size=t["tp_size"],
                                    connect_timeout_s=connect_timeout_s, max_connections=max_connections))
    return out


def build_sender(cfg: dict[str, Any], model: Any, engines: Sequence[Any]) -> Any:
    """The weight-sync sender [engines] asks for: the process group (default; master_address from the config, else
    this host's address the engines reach, 127.0.0.1 when all are local) or the disk fallback (logged)."""
    from trainer.weight_sync import DiskWeightSync, WeightSyncSender, default_master_address

    e = cfg.get("engines", {})
    if e.get("sync", "group") == "disk":
        sender = DiskWeightSync(model, engines, folder=e.get("sync_folder"))
        print(f"weight sync: disk fallback ([engines] sync = \"disk\"): every sync writes a safetensors folder "
              f"under {sender.folder} and each engine reloads it", flush=True)
        return sender
    address = e.get("master_address") or default_master_address([eng.url for eng in engines])
    return WeightSyncSender(model, engines, master_address=address, master_port=int(e.get("master_port", 0)))


@contextlib.contextmanager
def cores_left_to_trainer(cfg: dict[str, Any]):
    """On CPU, while embedded engines generate beside the trainer's steps on this host (async rollouts), give the
    trainer's intra-op (OpenMP) pool only the cores the engines leave free.

    An OpenMP region waits for its slowest thread: when an engine process wants a core that a trainer thread
    holds, every parallel region of the train step stalls. Measured on 2 busy cores with one engine thread, a GRPO
    train step took 20-51 s with 2 trainer threads and 1.1-1.2 s with 1. In synchronous mode the engines are idle
    while the trainer steps, so it keeps every core (on the quiet 2-core machine: 1.26-1.46 s train steps with 2
    threads vs 1.50-1.93 s with 1). Not applied on CUDA, with engines given by URL, or when OMP_NUM_THREADS is set
    (the user's choice wins)."""
    e = cfg.get("engines", {})
    started = sum(t["url"] is None and t["kind"] == "embedded" for t in fleet_of(e))
    engine_cores = started * int(e.get("threads", 1))
    overlapped = bool(cfg.get("rl", {}).get("async_rollout", False))
    if torch.cuda.is_available() or engine_cores == 0 or not overlapped or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - engine_cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- evaluation
def evaluate(urls: Sequence[Any], prompts: Sequence[Any], *, tokenizer: Any, reward_fn: Any, max_new_tokens: int,
             api_key: str | None = None, chat: bool = True) -> float:
    """Greedy accuracy (mean reward of one temperature-0 sample per prompt) served by the first engine (a URL of
    an SGLang-protocol server, or an engine object)."""
    from engines.protocol import SamplingParams
    from engines.sglang import SGLangEngine
    from trainer.rollout.rewards import compute_rewards, load_reward_fn
    from trainer.rollout.samples import prompt_token_ids, stop_token_ids
    from trainer.types import Sample, Status

    ids = [prompt_token_ids(tokenizer, p.prompt, chat=chat, system=p.system) for p in prompts]
    stop = tuple(stop_token_ids(tokenizer, chat=chat))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    engine = SGLangEngine(urls[0], api_key=api_key) if isinstance(urls[0], str) else urls[0]

    async def run():
        return await engine.generate(ids, params)

    outs = trio.run(run)
    samples = []
    for p, prompt_ids, group in zip(prompts, ids, outs):
        c = group[0]
        samples.append(Sample(prompt=p.prompt, tokens=tuple(prompt_ids) + tuple(c.output_ids),
                              response=tokenizer.decode(c.output_ids), response_length=len(c.output_ids),
                              metadata={**p.metadata, "answer": p.answer}, status=Status.COMPLETED))
    scored, n_failed = compute_rewards(samples, load_reward_fn(reward_fn))
    if n_failed == len(scored):
        raise RuntimeError(f"evaluation: the reward function failed on all {n_failed} samples; see its errors above")
    return sum(s.reward or 0.0 for s in scored) / max(len(scored), 1)


def sft_examples(prompts: Sequence[Any], tokenizer: Any, fmt: str) -> list[Any]:
    """SFT examples from prompt/answer records.

    chat: one-turn conversations (a record may carry full "messages" in its metadata instead), tokenized by
    trainer.sft with the assistant-only mask. plain: Samples `prompt + answer + eos`, the loss on answer + eos,
    exactly the token layout the rollouts of a plain-format run produce.
    """
    from trainer.rollout.samples import prompt_token_ids
    from trainer.types import Sample

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
def run(mode: str, cfg: dict[str, Any], *, resume: bool = False) -> dict[str, Any]:
    """Run `mode` end to end; returns the summary (also written to <output_dir>/summary.json on rank 0)."""
    from engines.tiny import build_tokenizer
    from trainer.backend.export import start_folder
    from trainer.backend.steps import broadcast_from_rank0, build_components, init_distributed
    from trainer.plot import plot_metrics
    from trainer.rl import run_rl_training
    from trainer.rollout.data import config_buffer, config_prompts
    from trainer.sft import run_sft_training

    t_start = time.time()
    out = Path(cfg["output_dir"])
    mesh = init_distributed()
    is_main = mesh.get_rank() == 0
    data = cfg.get("data", {})
    phases = phase_configs(cfg)
    tokenizer = build_tokenizer()
    if is_main and not resume:
        fresh_start(out, mode)
    model_folder = start_folder(cfg, prepare_model_folder(cfg, tokenizer)) if is_main else None
    model_folder = Path(broadcast_from_rank0(str(model_folder)))
    if (model_folder / "tokenizer.json").is_file():
        from engines.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_folder)
    reward_fn = data.get("reward", DEFAULT_REWARD)
    fmt = data.get("format", "chat")
    eval_prompts = config_prompts(data["eval"], data, where="[data].eval") if "eval" in data else []
    ev = cfg.get("eval", {})
    if ev.get("limit"):
        eval_prompts = eval_prompts[: int(ev["limit"])]
    api_key = cfg.get("engines", {}).get("api_key") or None
    rl_cfg = phases.rl if mode != "sft" else None
    summary: dict[str, Any] = {"mode": mode, "config": cfg.get("name")}
    engines_cm = engines_for(cfg, model_folder, is_main=is_main) if mode != "sft" else contextlib.nullcontext([])
    with engines_cm as fleet:
        fleet = broadcast_from_rank0(fleet)  # rank 0 started (or was given) the engines
        limits = ({"connect_timeout_s": rl_cfg.rollout.connect_timeout_s,
                   "max_connections": rl_cfg.rollout.max_concurrency} if rl_cfg is not None else {})
        engines = build_engines(fleet, model_folder, api_key=api_key, **limits)

        def accuracy(label: str) -> None:
            if is_main and eval_prompts and engines:
                acc = evaluate(engines, eval_prompts, tokenizer=tokenizer, reward_fn=reward_fn, api_key=api_key,
                               max_new_tokens=int(ev.get("max_new_tokens", rl_cfg.rollout.max_new_tokens if rl_cfg
                                                         else 16)),
                               chat=fmt == "chat")
                summary[f"accuracy_{label}"] = acc
                print(f"[{label}] held-out accuracy: {acc:.3f} on {len(eval_prompts)} problems", flush=True)

        components = None
        if mode in ("sft+rl", "demo", "rl") and engines:
            accuracy("before_sft" if mode != "rl" else "before_rl")
        if mode in ("sft", "sft+rl", "demo"):
            scfg = phases.sft
            sft_prompts = config_prompts(data.get("sft", data["train"]), data, where="[data].sft", seed=cfg["seed"])
            components, sft_state, sft_hist = run_sft_training(
                str(model_folder), sft_examples(sft_prompts, tokenizer, fmt), scfg, tokenizer=tokenizer, resume=resume,
                trainer_config=phases.sft_trainer)
            summary["sft_steps"] = sft_state.step
            summary["sft_final_loss"] = sft_hist[-1]["loss"] if sft_hist else None
            if is_main:
                plot_metrics(Path(scfg.output_dir) / "metrics.jsonl", out / "sft.png", title=f"{cfg['name']} SFT")
        if mode in ("rl", "sft+rl", "demo"):
            tcfg = phases.rl_trainer
            comp = build_components(components.module if components is not None else str(model_folder), tcfg)
            sender = build_sender(cfg, comp.model, engines)
            sender.init_group()
            if components is not None:  # engines serve the SFT weights from here on
                sender.sync(weight_version=0)
                accuracy("after_sft")
            buffer = config_buffer(data["train"], data, where="[data].train", seed=cfg["seed"])
            with cores_left_to_trainer(cfg):  # async: the engines generate while the trainer steps
                comp, state, hist = run_rl_training(None, buffer, rl_cfg, engines=engines, tokenizer=tokenizer,
                                                    reward_fn=reward_fn, trainer_config=tcfg, components=comp,
                                                    resume=resume, api_key=api_key, sender=sender)
            sender.close()
            summary["rl_steps"] = state.step
            summary["rl_final_reward_mean"] = hist[-1]["reward_mean"] if hist else None
            accuracy("after_rl")
            if is_main:
                plot_metrics(Path(rl_cfg.output_dir) / "metrics.jsonl", out / "rl.png", title=f"{cfg['name']} GRPO")
    summary["wall_seconds"] = round(time.time() - t_start, 1)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_table(summary: dict[str, Any]) -> None:
    rows = [("before SFT", "accuracy_before_sft"), ("after SFT", "accuracy_after_sft"),
            ("after RL", "accuracy_after_rl")]
    print("\n| stage | held-out accuracy |\n|---|---|")
    for label, key in rows:
        if key in summary:
            print(f"| {label} | {summary[key] * 100:.1f} % |")
    print(f"\nRL steps: {summary.get('rl_steps')}, wall time: {summary['wall_seconds']:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n")[0])
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
    args = ap.parse_args(argv)
    config = args.config or ("configs/demo.toml" if args.mode == "demo" else None)
    if config is None:
        ap.error(f"{args.mode}: --config is required (e.g. configs/demo.toml)")
    try:
        cfg = load_run_config(config, args.overrides, mode=args.mode)
    except ConfigError as e:  # configuration errors only: any other failure keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.mode == "export":
        from engines.tiny import build_tokenizer
        from trainer.backend.export import export_run

        try:
            folder = export_run(cfg, prepare_model_folder(cfg, build_tokenizer()), checkpoint=args.checkpoint,
                                out=args.out, dtype=args.dtype)
        except (ValueError, FileNotFoundError) as e:  # no such checkpoint, or one of another architecture
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"exported {folder}", flush=True)
        return 0
    try:
        summary = run(args.mode, cfg, resume=args.resume)
    except KeyboardInterrupt:
        print("interrupted: a checkpoint was written; continue with --resume", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 reports
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

