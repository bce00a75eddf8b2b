"""The one place that builds engine objects: an `EngineSpec` (a run config's engine entry) -> an `InferenceEngine`.

Every engine the project talks to (rollouts, evaluation, weight sync) is built here, from a config entry, by the
builder its kind names in `ENGINE_KINDS`. Adding an engine kind is one adapter module implementing
`engines.protocol.InferenceEngine` plus one entry in `ENGINE_KINDS`; the config validation (`EngineSpec`), the CLI
and the weight sync need no change.

Kinds:
    "sglang"    a SGLang server at `url` (`engines.sglang.SGLangEngine`; `tp_size` ranks in the weight-update group)
    "vllm"      a vLLM server at `url` with this project's weight-transfer plugin (`engines.vllm.VLLMEngine`;
                `model`: its served model name, default the model folder)
    "embedded"  this project's embedded engine process, spoken to over SGLang's protocol; an entry without `url`
                is started by the run (trainer.cli.engines_for), which fills the URL in before it is built
    "local"     the embedded engine inside this process, no HTTP (`engines.local.LocalEngine`, built from the
                model folder and the run's seed, on `device`: the trainer's own, so a one-GPU run generates on the
                GPU in its dtype); the caller owns it and calls its `close()`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from engines.protocol import InferenceEngine


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine of a run's fleet ([engines].fleet entry). Validated on construction; the errors name the field.

    kind: a key of ENGINE_KINDS. url: the server's http(s):// address (None: an "embedded" engine the run starts,
    or the in-process "local" one). tp_size: the engine's tensor-parallel workers, each one rank of the
    weight-update group (1 for single-device kinds). model: vLLM's served model name (None: the model folder).
    api_key: this engine's key, where it differs from [engines].api_key (the run gives each engine it starts its
    own random key here); kept out of repr so a logged spec never shows it."""

    kind: str  # "sglang", "vllm", "embedded" or "local" (a key of ENGINE_KINDS)
    url: str | None = None  # the server's http(s):// address (None: an "embedded" engine the run starts, or "local")
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
        if self.url is None and entry.url == "required":
            raise ValueError(f"kind {self.kind!r} needs a url (only kind = \"embedded\" is started by the run)")
        if self.url is not None and entry.url == "none":
            raise ValueError(f"url = {self.url!r}: kind {self.kind!r} runs inside this process and takes no url; "
                             f"drop it, or use kind = \"embedded\" for an engine server at a URL")
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            raise ValueError(f"url = {self.url!r}: give an http(s):// URL")
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_size = {tp!r}: the engine's tensor-parallel size, an int >= 1")
        if entry.single_device and tp != 1:
            raise ValueError(f"tp_size = {tp}: the {self.kind} engine runs on one device; tp_size must be 1")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model = {self.model!r}: the served model name, a string (None: the model folder)")
        if self.device is not None and (self.kind != "embedded" or self.url is not None):
            raise ValueError(f"device = {self.device!r}: only an \"embedded\" engine the run starts (no url) is "
                             f"placed by the run; a server at a URL chose its device when it started")
        if self.device is not None and not (isinstance(self.device, str)
                                            and (self.device == "cpu" or self.device.startswith("cuda"))):
            raise ValueError(f"device = {self.device!r}: give \"cpu\" or \"cuda:N\"")
        if self.cpus is not None:
            object.__setattr__(self, "cpus", tuple(self.cpus))
            if self.kind != "embedded" or self.url is not None:
                raise ValueError(f"cpus = {list(self.cpus)}: only an \"embedded\" engine the run starts (no url) is "
                                 f"pinned by the run")
            if not self.cpus or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.cpus):
                raise ValueError(f"cpus = {list(self.cpus)}: give a non-empty list of core numbers, e.g. [0]")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("api_key: give this engine's key as a non-empty string (or leave it out to use "
                             "[engines].api_key)")


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
    timeout_s: float = 300.0  # one request's limit (HTTP kinds)
    threads: int | None = None  # an in-process engine's model thread: its torch threads (None: the process's)


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """A registry entry. build: (spec with its url filled in, options) -> engine. url: "required", "optional"
    (None: the run starts the engine and fills it in) or "none" (in process). single_device: tp_size must be 1."""

    build: Callable[[EngineSpec, BuildOptions], InferenceEngine]
    url: str = "required"
    single_device: bool = False


def _sglang(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.sglang import SGLangEngine

    return SGLangEngine(spec.url, api_key=opts.api_key, tp_size=spec.tp_size, connect_timeout_s=opts.connect_timeout_s,
                        max_connections=opts.max_connections, timeout_s=opts.timeout_s)


def _vllm(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.vllm import VLLMEngine

    return VLLMEngine(spec.url, spec.model or opts.model_folder, api_key=opts.api_key)


def _local(spec: EngineSpec, opts: BuildOptions) -> InferenceEngine:
    from engines.local import LocalEngine

    return LocalEngine(opts.model_folder, seed=opts.seed, device=opts.device, threads=opts.threads)


ENGINE_KINDS: dict[str, EngineKind] = {
    "sglang": EngineKind(_sglang),
    "vllm": EngineKind(_vllm),
    "embedded": EngineKind(_sglang, url="optional", single_device=True),
    "local": EngineKind(_local, url="none", single_device=True),
}


def build_engine(spec: EngineSpec, *, model_folder: str | Path, api_key: str | None = None, seed: int = 0,
                 connect_timeout_s: float = 10.0, max_connections: int = 64, device: str = "cpu",
                 timeout_s: float = 300.0, threads: int | None = None) -> InferenceEngine:
    """The engine object for `spec` (its kind's builder). An "embedded" spec must carry the URL of the started
    engine by now; a "local" engine is started here, in this process, on `device` (give the trainer's: an engine
    on another device than the trainer cannot take its weights by handle; close it with `close()`). The spec's own
    api_key wins over `api_key` (the fleet-wide one)."""
    entry = ENGINE_KINDS[spec.kind]
    if spec.url is None and entry.url == "optional":
        raise ValueError(f"kind {spec.kind!r} without a url: start the engine first (trainer.cli.engines_for "
                         f"starts one per such entry) and build it from EngineSpec(kind, url=<its URL>)")
    opts = BuildOptions(model_folder=str(model_folder), api_key=spec.api_key or api_key, seed=seed,
                        connect_timeout_s=connect_timeout_s, max_connections=max_connections, device=str(device),
                        timeout_s=timeout_s, threads=threads)
    return entry.build(spec, opts)
