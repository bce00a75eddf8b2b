"""The one place that builds engine objects and says what each kind of engine can do: an `EngineSpec` (a run
config's engine entry) -> an `InferenceEngine`.

Every engine the project talks to (rollouts, evaluation, weight sync) is built here, from a config entry, by the
builder its kind names in `ENGINE_KINDS`. Each `EngineKind` entry also declares the kind's capabilities and owns its
options: whether its completions report per-token weight versions ([rl] update_in_flight needs that), whether it
lives in the trainer's process, how the run launches one given without a url, which `EngineSpec` fields it reads
and how they are checked. Nothing else decides by kind name: adding an engine kind is one adapter module
implementing `engines.protocol.InferenceEngine` plus one entry in `ENGINE_KINDS`; the config validation
(`EngineSpec`), the CLI (its checks, the engines it starts, the fleet it builds) and the weight sync need no change.

Kinds:
    "sglang"    a SGLang server at `url` (`engines.sglang.SGLangEngine`; `tp_size` ranks in the weight-update group)
    "vllm"      a vLLM server at `url` with this project's weight-transfer plugin (`engines.vllm.VLLMEngine`;
                `model`: its served model name, default the model folder)
    "embedded"  this project's embedded engine process, spoken to over SGLang's protocol; an entry without `url`
                is launched by the run (trainer.run.engines_for, through the kind's `launch`), which fills the URL in
                before it is built
    "local"     the embedded engine inside this process, no HTTP (`engines.local.LocalEngine`, built from the
                model folder and the run's seed, on `device`: the trainer's own, so a one-GPU run generates on the
                GPU in its dtype); the caller owns it and calls its `close()`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from engines.protocol import InferenceEngine

# The EngineSpec fields that belong to some kinds only: a kind lists the ones it reads in `options` or
# `launch_options`, and a value set on any other kind is an error that names the field and the kinds that read it.
KIND_OPTIONS = ("model", "device", "cpus")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine of a run's fleet ([engines].fleet entry). Validated on construction (the generic fields here, the
    kind's own through its ENGINE_KINDS entry); the errors name the field.

    kind: a key of ENGINE_KINDS. url: the server's http(s):// address (None: an engine the run launches, or an
    in-process one). tp_size: the engine's tensor-parallel workers, each one rank of the weight-update group (1 for
    single-device kinds). model: vLLM's served model name (None: the model folder). api_key: this engine's key,
    where it differs from [engines].api_key (the run gives each engine it starts its own random key here); kept out
    of repr so a logged spec never shows it."""

    kind: str  # "sglang", "vllm", "embedded", "local" or "tinker" (a key of ENGINE_KINDS)
    url: str | None = None  # the server's http(s):// address (None: an engine the run launches, or an in-process one)
    tp_size: int = 1  # tensor-parallel workers: each is one rank of the weight-update group
    model: str | None = None  # vLLM's served model name (None: the model folder)
    api_key: str | None = dataclasses.field(default=None, repr=False)  # this engine's key (None: [engines].api_key)
    device: str | None = None  # where an "embedded" engine the run starts runs ("cuda:1", "cpu"; None: placed by it)
    # The CPU cores an "embedded" engine the run starts is pinned to, one torch thread each (None: not pinned). With
    # [trainer] cpus on other cores, engines and trainer stop competing for cores: a stand-in for separate GPUs.
    cpus: tuple[int, ...] | None = None

    def __post_init__(self):
        entry = ENGINE_KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if entry is None:
            raise ValueError(f"kind = {self.kind!r}: choose one of {tuple(ENGINE_KINDS)}")
        if self.url is None and entry.url_rule == "required":
            raise ValueError(f"kind {self.kind!r} needs a url (the kinds the run starts itself: "
                             f"{', '.join(kinds_where(lambda k: k.launch is not None))})")
        if self.url is not None and entry.url_rule == "none":
            raise ValueError(f"url = {self.url!r}: kind {self.kind!r} runs inside this process and takes no url; "
                             f"drop it, or use a kind that runs as a server (e.g. \"embedded\") at a URL")
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            raise ValueError(f"url = {self.url!r}: give an http(s):// URL")
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_size = {tp!r}: the engine's tensor-parallel size, an int >= 1")
        if entry.single_device and tp != 1:
            raise ValueError(f"tp_size = {tp}: the {self.kind} engine runs on one device; tp_size must be 1")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("api_key: give this engine's key as a non-empty string (or leave it out to use "
                             "[engines].api_key)")
        if isinstance(self.cpus, list):
            object.__setattr__(self, "cpus", tuple(self.cpus))
        for name in KIND_OPTIONS:
            _check_kind_option(self, entry, name)
        if entry.check is not None:
            entry.check(self)


def _check_kind_option(spec: EngineSpec, entry: EngineKind, name: str) -> None:
    """A kind's own field `name` is set only on a kind that reads it, and a launch option only without a url."""
    value = getattr(spec, name)
    if value is None:
        return
    shown = list(value) if isinstance(value, tuple) else value
    if name in entry.launch_options and spec.url is None:
        return
    if name in entry.options:
        return
    launchers = kinds_where(lambda k: name in k.launch_options)
    if launchers:
        named = " or ".join(f"{'an' if k[0] in 'aeiou' else 'a'} \"{k}\"" for k in launchers)
        raise ValueError(f"{name} = {shown!r}: only {named} engine the run starts (no url) reads it; a server at a "
                         f"URL was set up when it started; drop {name} (or the url)")
    raise ValueError(f"{name} = {shown!r}: kind {spec.kind!r} does not read it (the kinds that do: "
                     f"{', '.join(kinds_where(lambda k: name in k.options))}); drop it")


def _check_placement(spec: EngineSpec) -> None:
    """An engine the run launches: its `device` and `cpus` values (only such a spec sets them: _check_kind_option)."""
    if spec.device is not None and not (isinstance(spec.device, str)
                                        and (spec.device == "cpu" or spec.device.startswith("cuda"))):
        raise ValueError(f"device = {spec.device!r}: give \"cpu\" or \"cuda:N\"")
    if spec.cpus is not None and (not isinstance(spec.cpus, tuple) or not spec.cpus or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in spec.cpus)):
        raise ValueError(f"cpus = {spec.cpus!r}: give a non-empty list of core numbers, e.g. [0]")


def _check_served_model(spec: EngineSpec) -> None:
    if spec.model is not None and not isinstance(spec.model, str):
        raise ValueError(f"model = {spec.model!r}: the served model name, a string (None: the model folder)")


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What every builder may use beside the spec: the run's model folder and seed, the API key, HTTP limits, and
    the device an in-process engine runs on ("cpu", "cuda:0", ...)."""

    model_folder: str
    api_key: str | None = None
    seed: int = 0
    device: str = "cpu"
    connect_timeout_s: float = 10.0
    max_connections: int = 64
    request_timeout_s: float = 120.0  # one request's limit (HTTP kinds): the run's [rl.rollout] request_timeout_s
    threads: int | None = None  # an in-process engine's model thread: its torch threads (None: the process's)
    prefix_cache_tokens: int | None = None  # an embedded engine's prefix-cache budget (None: its default; 0: off)
    speculative_tokens: int = 0  # an embedded engine's draft tokens a row and step (engines/embedded/drafts.py; 0: off)
    dtype: str | None = None  # an in-process engine's weights ("float32", "bfloat16"; None: the engine's default)
    borrow_cores: bool = False  # an in-process engine: its callers wait while it generates (engines.local.LocalEngine)
    cuda_graphs: bool = False  # an embedded engine's decode steps as CUDA graphs (engines/embedded/graphs.py)
    kv_cache_tokens: int | None = None  # an embedded engine's KV budget in cells (None: its default)
    share_stream: bool = False  # an in-process engine on CUDA: generate on the trainer's compute stream


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What a kind's `launch` may use beside the spec: the run's model folder, seed and key for the engine, its
    threads (when the spec pins no cores), how long it may take to answer, and the device the run placed it on."""

    model_folder: str
    api_key: str
    seed: int = 0
    threads: int = 1
    start_timeout_s: float = 180.0
    device: str | None = None  # placed by the run (trainer.run.engine_devices); None: the engine's default
    prefix_cache_tokens: int | None = None  # the embedded engine's prefix-cache budget (None: its default; 0: off)
    speculative_tokens: int = 0  # the embedded engine's draft tokens a row and step (0: off)
    cuda_graphs: bool = False  # the embedded engine's decode steps as CUDA graphs (engines/embedded/graphs.py)
    dtype: str | None = None  # the embedded engine's weights ("float32", "bfloat16"; None: its default for its device)
    kv_cache_tokens: int | None = None  # the embedded engine's KV budget in cells (None: its default)


class LaunchedEngine(Protocol):
    """An engine process the run started (engines.embedded.launch.EngineProcess is one): `launch` spawns it without
    waiting, `wait_healthy` blocks until it answers at `url` (raising when it exits or times out), `kill` stops it."""

    url: str

    def launch(self) -> object: ...

    def wait_healthy(self) -> object: ...

    def kill(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """A registry entry: how a kind is built, and what it can do.

    build: (spec with its url filled in, options) -> engine.
    launch: (spec without url, options) -> a LaunchedEngine the run starts (None: the kind is not launchable, a spec
        needs a url, or it is in process). Launchable kinds take a url too (a server started by someone else).
    in_process: the engine lives in the trainer's process (url none; built on the trainer's device by the run,
        which closes it, engines.protocol.InProcessEngine): single-process trainers only, no rollout process worker.
    single_device: tp_size must be 1.
    reports_token_versions: its completions carry `weight_versions` (which weights made which token), so weights
        may be synced while its requests run ([rl] update_in_flight).
    lora_adapters: it serves named LoRA adapters (load_adapter / generate(adapter=)) given how it was started.
    openai_routes: its server answers OpenAI's /v1/chat/completions, /v1/completions and /v1/models at its url.
    options: the KIND_OPTIONS fields it reads; launch_options: those it reads only when the run launches it (set
        with a url they are errors; cleared once it runs at its URL). check: the values of its own fields."""

    build: Callable[[EngineSpec, BuildOptions], InferenceEngine]
    launch: Callable[[EngineSpec, LaunchOptions], LaunchedEngine] | None = None
    in_process: bool = False
    single_device: bool = False
    reports_token_versions: bool = False
    lora_adapters: bool = False
    openai_routes: bool = False
    options: tuple[str, ...] = ()
    launch_options: tuple[str, ...] = ()
    check: Callable[[EngineSpec], None] | None = None

    def __post_init__(self):
        assert not (self.in_process and self.launch is not None), "an in-process kind is built, not launched"
        unknown = set(self.options) | set(self.launch_options)
        assert unknown <= set(KIND_OPTIONS), f"options {sorted(unknown - set(KIND_OPTIONS))}: not EngineSpec fields"
        assert not self.launch_options or self.launch is not None, "launch_options without a launch"

    @property
    def url_rule(self) -> str:
        """"none" (in process), "optional" (None: the run launches it) or "required"."""
        return "none" if self.in_process else "optional" if self.launch is not None else "required"


def _sglang(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.sglang import SGLangEngine

    return SGLangEngine(spec.url, api_key=opts.api_key, tp_size=spec.tp_size, connect_timeout_s=opts.connect_timeout_s,
                        max_connections=opts.max_connections, timeout_s=opts.request_timeout_s)


def _vllm(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.vllm import VLLMEngine

    return VLLMEngine(spec.url, spec.model or opts.model_folder, api_key=opts.api_key,
                      timeout_s=opts.request_timeout_s)


def _local(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    import torch

    from engines.local import LocalEngine

    given = {} if opts.prefix_cache_tokens is None else {"prefix_cache_tokens": opts.prefix_cache_tokens}
    if opts.dtype is not None:  # else the engine's default for its device
        given["dtype"] = getattr(torch, opts.dtype)
    if opts.speculative_tokens:
        given["speculative_tokens"] = opts.speculative_tokens
    if opts.cuda_graphs:
        given["cuda_graphs"] = True
    if opts.kv_cache_tokens is not None:
        given["kv_cache_tokens"] = opts.kv_cache_tokens
    if opts.share_stream:
        given["share_stream"] = True
    return LocalEngine(opts.model_folder, seed=opts.seed, device=opts.device, threads=opts.threads,
                       borrow_cores=opts.borrow_cores, **given)


def _tinker(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.tinker import TinkerEngine

    return TinkerEngine(spec.url, api_key=opts.api_key)


def _launch_embedded(spec: EngineSpec, opts: LaunchOptions) -> LaunchedEngine:
    """The embedded engine as a process (`python -m engines.embedded`); pinned to `spec.cpus`, one thread each."""
    from engines.embedded.launch import EngineProcess

    return EngineProcess(opts.model_folder, api_key=opts.api_key, seed=opts.seed, start_timeout_s=opts.start_timeout_s,
                         threads=len(spec.cpus) if spec.cpus else opts.threads, device=opts.device, cpus=spec.cpus,
                         extra_args=(() if opts.prefix_cache_tokens is None else
                                     ("--prefix-cache-tokens", str(opts.prefix_cache_tokens)))
                         + (("--speculative-tokens", str(opts.speculative_tokens)) if opts.speculative_tokens else ())
                         + (("--cuda-graphs",) if opts.cuda_graphs else ())
                         + (("--dtype", opts.dtype) if opts.dtype else ())
                         + (("--kv-cache-tokens", str(opts.kv_cache_tokens)) if opts.kv_cache_tokens else ()))


ENGINE_KINDS: dict[str, EngineKind] = {
    "sglang": EngineKind(_sglang, lora_adapters=True, openai_routes=True),
    "vllm": EngineKind(_vllm, lora_adapters=True, openai_routes=True, options=("model",), check=_check_served_model),
    "embedded": EngineKind(_sglang, launch=_launch_embedded, single_device=True, reports_token_versions=True,
                           lora_adapters=True, openai_routes=True, launch_options=("device", "cpus"),
                           check=_check_placement),
    "local": EngineKind(_local, in_process=True, single_device=True, reports_token_versions=True, lora_adapters=True),
    # Samples a Tinker-API server's current weights ([trainer] backend = "tinker"): synced by a new SamplingClient
    # (trainer.backend.remote.TinkerSync), no tensors move.
    "tinker": EngineKind(_tinker),
}


def kinds_where(has: Callable[[EngineKind], bool]) -> tuple[str, ...]:
    """The kinds whose entry satisfies `has` (for messages that name the kinds able to do something)."""
    return tuple(name for name, entry in ENGINE_KINDS.items() if has(entry))


def engine_kind(spec: EngineSpec) -> EngineKind:
    """The registry entry of `spec`'s kind (a valid EngineSpec always has one)."""
    return ENGINE_KINDS[spec.kind]


def launched_by_run(spec: EngineSpec) -> bool:
    """Whether the run starts this engine as a process (a launchable kind given no url)."""
    return spec.url is None and engine_kind(spec).launch is not None


def launch_engine(spec: EngineSpec, opts: LaunchOptions) -> LaunchedEngine:
    """The (not yet spawned) process of an engine the run starts: its kind's launcher."""
    assert launched_by_run(spec), f"{spec!r}: not an engine the run launches"
    return engine_kind(spec).launch(spec, opts)


def started_spec(spec: EngineSpec, url: str, api_key: str) -> EngineSpec:
    """The spec of a launched engine once it answers: a server at `url` with `api_key`; the options read only to
    launch it (its device, its cores) were the process's to take and are cleared."""
    cleared = {name: None for name in engine_kind(spec).launch_options}
    return dataclasses.replace(spec, url=url, api_key=api_key, **cleared)


def build_engine(spec: EngineSpec, *, model_folder: str | Path, api_key: str | None = None, seed: int = 0,
                 connect_timeout_s: float = 10.0, max_connections: int = 64, device: str = "cpu",
                 request_timeout_s: float = 120.0, threads: int | None = None,
                 prefix_cache_tokens: int | None = None, speculative_tokens: int = 0,
                 dtype: str | None = None, borrow_cores: bool = False, cuda_graphs: bool = False,
                 kv_cache_tokens: int | None = None, share_stream: bool = False) -> InferenceEngine:
    """The engine object for `spec` (its kind's builder). A launchable spec must carry the URL of the started
    engine by now; an in-process engine is started here, in this process, on `device` (give the trainer's: an engine
    on another device than the trainer cannot take its weights by handle; close it with `close()`). The spec's own
    api_key wins over `api_key` (the fleet-wide one)."""
    entry = engine_kind(spec)
    if spec.url is None and entry.url_rule == "optional":
        raise ValueError(f"kind {spec.kind!r} without a url: start the engine first (trainer.run.engines_for "
                         f"starts one per such entry) and build it from EngineSpec(kind, url=<its URL>)")
    opts = BuildOptions(model_folder=str(model_folder), api_key=spec.api_key or api_key, seed=seed,
                        connect_timeout_s=connect_timeout_s, max_connections=max_connections, device=str(device),
                        request_timeout_s=request_timeout_s, threads=threads, prefix_cache_tokens=prefix_cache_tokens,
                        speculative_tokens=speculative_tokens, dtype=dtype, borrow_cores=borrow_cores,
                        cuda_graphs=cuda_graphs, kv_cache_tokens=kv_cache_tokens, share_stream=share_stream)
    return entry.build(spec, opts)
