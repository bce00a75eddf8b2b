"""A run's orchestration: the model folder, the engine fleet (launched, in process, or at URLs), the weight-sync
sender, the SFT and RL phases with their evaluation, metrics loggers and plots, and the summary. `run(mode, cfg)`
is what `python -m trainer {sft,rl,sft+rl,demo}` calls after the preflight (trainer.preflight)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engines.protocol import InferenceEngine, InProcessEngine
from kernels.device import tune_host_malloc
from trainer.config import (
    ConfigError,
    RunConfig,
)
from trainer.config_reference import to_toml
from trainer.data.sft_examples import sft_examples
from trainer.preflight import PhaseConfigs, check_run_config, has_eval_sets, phase_configs
from trainer.run_folder import fresh_start

if TYPE_CHECKING:
    from trainer.weight_sync import WeightSync






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


def lends_cores(cfg: RunConfig, device: str, *, in_process: int, processes: int) -> bool:
    """Whether the run's one in-process engine decodes on the trainer's cores ([engines] lend_cores): on CPU, in
    synchronous RL (the trainer waits while it generates), with no other engine this run starts beside it (engine
    processes and a second in-process engine would generate at the same time on the same cores)."""
    return (cfg.engines.lend_cores and not cfg.rl.async_rollout and str(device) == "cpu" and in_process == 1
            and processes == 0)


def shares_stream(cfg: RunConfig, device: str) -> bool:
    """Whether the run's in-process engines generate on the trainer's compute stream (kernels.device.shared_stream):
    on CUDA, in synchronous RL, where the trainer waits while they generate, so sharing one pool of cached blocks
    costs no overlap. Async RL keeps them on their own stream (they generate while the trainer trains)."""
    return not cfg.rl.async_rollout and str(device).startswith("cuda")


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
                                                   prefix_cache_tokens=prefix_cache_tokens(cfg),
                                                   speculative_tokens=e.speculative_tokens,
                                                   cuda_graphs=e.cuda_graphs, dtype=engine_dtype(cfg, place),
                                                   kv_cache_tokens=e.kv_cache_tokens))
             for i, place in zip(to_start, places)]
    started: list[InProcessEngine] = []
    lend = lends_cores(cfg, device, in_process=len(local), processes=len(to_start))
    try:
        for p in procs:
            p.launch()
        for i in local:
            started.append(build_engine(fleet[i], model_folder=model_folder, seed=cfg.seed, device=device,
                                        threads=torch.get_num_threads() if lend else e.threads, borrow_cores=lend,
                                        prefix_cache_tokens=prefix_cache_tokens(cfg),
                                        speculative_tokens=e.speculative_tokens, cuda_graphs=e.cuda_graphs,
                                        dtype=engine_dtype(cfg, device), kv_cache_tokens=e.kv_cache_tokens,
                                        share_stream=shares_stream(cfg, device)))
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
                  connect_timeout_s: float = 10.0, max_connections: int = 64,
                  request_timeout_s: float = 120.0) -> list[InferenceEngine]:
    """Engine objects for a fleet, each built by engines.registry.build_engine from its EngineSpec (a dict entry
    {url, kind, tp_size, model, api_key} is read as one). An entry that carries its started object under "engine" (the
    in-process engine engines_for started and owns) is that object. request_timeout_s: one request's limit, the run's
    [rl.rollout] request_timeout_s (the rollout manager bounds its generate requests by it too, in-process ones
    included; evaluation and judges reach the engines through these clients)."""
    from engines.registry import EngineSpec, build_engine

    out = []
    for t in fleet:
        if isinstance(t, dict) and t.get("engine") is not None:
            out.append(t["engine"])
            continue
        fields = [f.name for f in dataclasses.fields(EngineSpec)]
        spec = t if isinstance(t, EngineSpec) else EngineSpec(**{k: t[k] for k in fields if k in t})
        out.append(build_engine(spec, model_folder=model_folder, api_key=api_key,
                                connect_timeout_s=connect_timeout_s, max_connections=max_connections,
                                request_timeout_s=request_timeout_s))
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
    return getattr(torch, engine_dtype(cfg, next(model.parameters()).device.type))


def engine_dtype(cfg: RunConfig, device: str | None) -> str:
    """The dtype an engine on `device` serves (None: the embedded engine's default device, CUDA when there is one):
    [engines] dtype, else the one the trainer computes in there ([trainer] param_dtype: bfloat16 on CUDA, float32
    on CPU), so that an fp32 run samples from fp32 weights (issue 42: embedded engines took bfloat16 on CUDA
    whatever the trainer computed in, and the engine-vs-trainer mismatch was bf16's)."""
    from trainer.backend.parallel import compute_dtype

    if cfg.engines.dtype is not None:
        return cfg.engines.dtype
    kind = str(device).split(":")[0] if device else ("cuda" if torch.cuda.is_available() else "cpu")
    return str(compute_dtype(kind, cfg.trainer)).removeprefix("torch.")


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


def run(mode: str, cfg: RunConfig, *, resume: bool = False, checked: bool = False) -> dict[str, Any]:
    """Run `mode` end to end; returns the summary (also written to <output_dir>/summary.json on rank 0).

    The preflight (trainer.preflight.check_run_config) runs first, so a RunConfig built in Python is checked as
    the CLI's is, before any work; `checked=True` says the caller ran it for this mode already (the CLI's
    load_run_config). A problem is a ConfigError naming the key."""
    if not checked:
        try:
            check_run_config(cfg, mode, resume=resume)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from e
    from trainer.backend.export import start_folder
    from trainer.backend.steps import broadcast_from_rank0, init_distributed, mesh_device
    from trainer.evaluation import Evaluator, eval_sets

    t_start = time.time()
    out = Path(cfg.output_dir)
    pin_trainer(cfg)
    if not torch.cuda.is_available():  # a CPU run: its steps reuse the memory the last one freed (the docstring)
        tune_host_malloc()
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
                                connect_timeout_s=rollout.connect_timeout_s, max_connections=rollout.max_concurrency,
                                request_timeout_s=rollout.request_timeout_s)
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
    from trainer.data.buffer import config_prompts, warn_unknown_characters
    from trainer.evaluation import Evaluation
    from trainer.plot import plot_metrics
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
    from trainer.data.buffer import config_buffer, warn_unknown_characters
    from trainer.evaluation import Evaluation
    from trainer.plot import plot_metrics
    from trainer.rl import run_rl_training
    from trainer.rollout.dumps import RolloutDumps

    data, rl_cfg, tcfg = r.cfg.data, r.phases.rl, r.phases.rl_trainer
    if r.cfg.trainer.backend == "tinker":  # the optimisation on a Tinker-API server (trainer/backend/remote.py)
        comp, (backend, sender) = None, _remote_trainer(r, engines)
    else:
        (comp, sender), backend = _local_trainer(r, engines, sft_components, sender), None
    rewards = _reward_sources(r, engines, device=str(comp.device) if comp is not None else "cpu")
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
                                            backend=backend, resume=r.resume, sender=sender,
                                            evaluation=evaluation, dumps=dumps if dumps.every else None,
                                            logger=_logger(r, "rl", rl_cfg.output_dir))
    sender.close()
    r.summary.update(rl_steps=state.step, rl_final_reward_mean=hist[-1]["reward_mean"] if hist else None)
    if r.is_main:
        plot_metrics(Path(rl_cfg.output_dir) / "metrics.jsonl", Path(r.cfg.output_dir) / "rl.png",
                     title=f"{r.cfg.name} {'PPO with a critic' if rl_cfg.critic is not None else 'GRPO'}")


def _local_trainer(r: _Run, engines: Sequence[InferenceEngine], sft_components: Any,
                   sender: WeightSync | None) -> tuple[Any, WeightSync]:
    """RL's components in this process (from the SFT weights in memory, or the model folder) and the sender that
    syncs the engines to them (SFT's, when it had one and the policy is the same model)."""
    from trainer.backend.memory import release_phase_memory
    from trainer.backend.steps import build_components

    rl_cfg, tcfg = r.phases.rl, r.phases.rl_trainer
    if sft_components is not None:  # SFT's AdamW state is not RL's: freed (and on CUDA returned) before RL builds
        release_phase_memory(sft_components)
    comp = build_components(sft_components.root if sft_components is not None else str(r.model_folder), tcfg)
    if tcfg.lora is not None and r.is_main:  # what `export` merges the adapters into: SFT's result, or the folder
        from trainer.backend.export import record_lora_base

        record_lora_base(rl_cfg.output_dir, **({"sft_dir": r.phases.sft.output_dir} if sft_components is not None
                                               else {"folder": r.model_folder}))
    if sender is not None and comp.model is not sft_components.model:  # a copy: the policy gained a value head
        sender.close()
        sender = None
    if sender is None:
        sender = build_sender(r.cfg, comp.model, engines)
        sender.init_group()
    return comp, sender


def _remote_trainer(r: _Run, engines: Sequence[InferenceEngine]) -> tuple[Any, WeightSync]:
    """[trainer] backend = "tinker": one LoRA training client on the server (trainer.backend.remote.connect: its
    health asked first) and the sync that hands the "tinker" engines its newest sampler."""
    from trainer.backend.remote import TinkerSync, connect

    remote = connect(r.cfg.trainer, r.phases.rl, model=r.cfg.model.path or str(r.model_folder))
    return remote, TinkerSync(remote.remote, engines)


def _reward_sources(r: _Run, engines: Sequence[InferenceEngine], *, device: str) -> Any:
    """The run's reward (trainer.rewards.sources.RewardSources), built once: the [rewards] sources (reward
    models loaded on the trainer's `device`, judges on their engines), or without them [data].reward alone. Rank 0
    scores the rollouts; the other ranks never do, and build the [data].reward shorthand only."""
    from trainer.config import RewardsConfig
    from trainer.rewards.sources import build_reward_sources, describe_rewards

    config = r.cfg.rewards if r.is_main else RewardsConfig()
    if config.sources:
        print(describe_rewards(config, r.cfg.data.reward), flush=True)
    # A rollout process scores the batches with sources of its own (its reward models loaded there): the trainer's
    # process loads none.
    in_child = r.cfg.rl.rollout_worker == "process"
    return build_reward_sources(config, default_rule=r.cfg.data.reward, engines=engines, tokenizer=r.tokenizer,
                                device=device, timeout_s=r.cfg.data.reward_timeout_s, load_models=not in_child)
