"""An engine kind is one class implementing engines.protocol.InferenceEngine plus one engines.registry entry that
declares what it can do: the config, the CLI's checks, the engines the run starts and the fleet it builds, and the
rollouts take a new kind with no other edit. And nothing in trainer/ probes an engine object with getattr/hasattr.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import typing
from pathlib import Path

import pytest
import trio

from engines import registry
from engines.protocol import Completion, InferenceEngine, InProcessEngine, SamplingParams
from engines.tiny import build_tokenizer
from trainer.cli import build_engines, engines_for, load_run_config
from trainer.config import ConfigError, EnginesConfig, RLTrainingConfig
from trainer.data.buffer import DataBuffer, Prompt
from trainer.preflight import check_engines
from trainer.rollout.manager import AsyncRolloutManager

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
TOK = build_tokenizer()


class SumEngine:
    """A complete InferenceEngine (every method engines.protocol declares, the weight sync's included): answers an
    arithmetic prompt "a+b=" with a + b + j for its j-th sample, at its weight version, with per-token versions."""

    def __init__(self, url: str, folder: str, seed: int = 0) -> None:
        self.url, self.folder, self.seed = url, folder, seed
        self.version, self.calls, self.closed = 0, [], 0

    async def health(self) -> bool:
        return True

    async def generate(self, prompts, params: SamplingParams, *, rids=None, adapter=None):
        self.calls.append(("generate", len(prompts), params.n, adapter))
        out = []
        for ids in prompts:
            a, b = TOK.decode(ids)[:-1].split("+")
            group = []
            for j in range(params.n):
                toks = TOK(str(int(a) + int(b) + j), add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                group.append(Completion(toks, [-0.25] * len(toks), "stop", self.version, list(ids),
                                        weight_versions=((0, self.version),)))
            out.append(group)
        return out

    async def load_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load_adapter", name))

    async def unload_adapter(self, name: str) -> None:
        self.calls.append(("unload_adapter", name))

    async def abort(self, rids=None) -> None:
        self.calls.append(("abort", rids))

    async def get_weight_version(self) -> int:
        return self.version

    async def pause_generation(self) -> None:
        self.calls.append(("pause",))

    async def continue_generation(self) -> None:
        self.calls.append(("continue",))

    async def flush_cache(self) -> None:
        pass

    async def aclose(self) -> None:
        self.calls.append(("aclose",))

    async def world_size(self) -> int:
        return 1

    async def weight_formats(self) -> tuple[str, ...]:
        return ("direct",)

    async def colocation_info(self) -> dict:
        return {}

    async def colocated_weights(self, body: dict) -> dict:
        raise AssertionError("colocation_info() is {}: never called")

    async def gpu_uuids(self):
        return ()

    async def init_weights_update_group(self, *, master_address, master_port, rank_offset, world_size, group_name,
                                        backend, timeout_s=None) -> None:
        pass

    async def update_weights_from_distributed(self, meta: dict) -> None:
        self.version = int(meta.get("weight_version", self.version + 1))

    async def update_weights_from_disk(self, model_path: str, *, weight_version=None) -> None:
        self.version = self.version + 1 if weight_version is None else weight_version


class InProcessSumEngine(SumEngine):
    """The same engine living in the trainer's process: the run closes it."""

    def close(self) -> None:
        self.closed += 1


class FakeProcess:
    """What a kind's `launch` returns (registry.LaunchedEngine): records launch / wait_healthy / kill."""

    def __init__(self, spec, opts):
        self.spec, self.opts, self.events = spec, opts, []
        self.url = f"http://127.0.0.1:{random.randrange(20000, 60000)}"

    def launch(self):
        self.events.append("launch")
        return self

    def wait_healthy(self):
        self.events.append("healthy")
        return self

    def kill(self) -> None:
        self.events.append("kill")


def _check_device(spec) -> None:
    if spec.device is not None and spec.device not in ("cpu", "npu"):
        raise ValueError(f"device = {spec.device!r}: the sum engine runs on \"cpu\" or \"npu\"")


@pytest.fixture
def new_kinds(monkeypatch):
    """Three new kinds, each one registry entry: "sum" (launchable, reports token versions, reads `device` to
    launch), "sumurl" (a server at a URL, no token versions) and "suminproc" (in the trainer's process)."""
    launched: list[FakeProcess] = []

    def launch(spec, opts):
        launched.append(FakeProcess(spec, opts))
        return launched[-1]

    kinds = {
        "sum": registry.EngineKind(lambda spec, opts: SumEngine(spec.url, opts.model_folder, opts.seed),
                                   launch=launch, reports_token_versions=True, launch_options=("device",),
                                   check=_check_device),
        "sumurl": registry.EngineKind(lambda spec, opts: SumEngine(spec.url, opts.model_folder)),
        "suminproc": registry.EngineKind(lambda spec, opts: InProcessSumEngine("inproc://sum", opts.model_folder),
                                         in_process=True, single_device=True, reports_token_versions=True),
    }
    for name, kind in kinds.items():
        monkeypatch.setitem(registry.ENGINE_KINDS, name, kind)
    return launched


def test_the_engine_classes_implement_the_whole_protocol():
    assert isinstance(SumEngine("http://h:1", "/m"), InferenceEngine)
    assert isinstance(InProcessSumEngine("inproc://x", "/m"), InProcessEngine)
    assert not isinstance(SumEngine("http://h:1", "/m"), InProcessEngine)  # no close(): the run does not own it


def test_the_built_in_kinds_declare_what_the_name_checks_used_to_decide():
    """What trainer/cli.py once decided by name ("embedded" launched, "local" in process, both with token versions)
    is now each entry's; the objects the URL kinds build are engines the run does not own (no close)."""
    from engines.registry import ENGINE_KINDS, EngineSpec, build_engine, kinds_where

    assert kinds_where(lambda k: k.launch is not None) == ("embedded",)
    assert kinds_where(lambda k: k.in_process) == ("local",)
    assert kinds_where(lambda k: k.reports_token_versions) == ("embedded", "local")
    assert kinds_where(lambda k: k.single_device) == ("embedded", "local")
    assert kinds_where(lambda k: k.openai_routes) == ("sglang", "vllm", "embedded")  # "local" has no URL to serve
    assert ENGINE_KINDS["embedded"].launch_options == ("device", "cpus") and ENGINE_KINDS["vllm"].options == ("model",)
    for kind in ("sglang", "vllm", "embedded"):
        engine = build_engine(EngineSpec(kind, "http://h:1"), model_folder="/m")
        assert isinstance(engine, InferenceEngine) and not isinstance(engine, InProcessEngine), kind


def test_a_new_kind_is_validated_by_its_own_entry(new_kinds):
    from engines.registry import EngineSpec

    assert EngineSpec("sum").url is None and EngineSpec("sum", device="npu").device == "npu"
    with pytest.raises(ValueError, match=r"device = 'tpu': the sum engine runs on"):  # the kind's own check
        EngineSpec("sum", device="tpu")
    with pytest.raises(ValueError, match=r"device = 'cpu': only an \"embedded\" or a \"sum\" engine the run starts"):
        EngineSpec("sum", url="http://h:1", device="cpu")  # a launch option with a url
    with pytest.raises(ValueError, match=r"device = 'cpu': only .*engine the run starts"):
        EngineSpec("sumurl", url="http://h:1", device="cpu")  # not its option at all
    with pytest.raises(ValueError, match=r"model = 'm': kind 'sum' does not read it \(the kinds that do: vllm\)"):
        EngineSpec("sum", model="m")
    with pytest.raises(ValueError, match="needs a url"):
        EngineSpec("sumurl")
    with pytest.raises(ValueError, match="takes no url"):
        EngineSpec("suminproc", url="http://h:1")
    with pytest.raises(ValueError, match="one device"):
        EngineSpec("suminproc", tp_size=2)
    # The built-in kinds' options are theirs too: vLLM's served model name, the embedded engine's placement.
    assert EngineSpec("vllm", "http://h:1", model="served").model == "served"
    with pytest.raises(ValueError, match="kind 'sglang' does not read it"):
        EngineSpec("sglang", "http://h:1", model="served")
    assert EngineSpec("embedded", cpus=[0, 1]).cpus == (0, 1)
    with pytest.raises(ValueError, match="only an \"embedded\" .*engine the run starts"):
        EngineSpec("embedded", url="http://h:1", cpus=(0,))


def test_the_config_and_the_cli_checks_read_what_a_kind_declares(new_kinds, monkeypatch):
    cfg = load_run_config(DEMO, ["engines.in_process=false", 'engines.fleet=[{kind = "sum", device = "npu"}, '
                                 '{kind = "sum"}]', "rl.update_in_flight=true", "rl.async_rollout=true"])
    assert [s.kind for s in cfg.engines.fleet] == ["sum", "sum"] and cfg.engines.started_here == 2
    assert cfg.engines.fleet[0].device == "npu"
    # update_in_flight needs token versions: refused for the kind that does not declare them, naming those that do.
    with pytest.raises(ConfigError, match=r"update_in_flight = true needs .*\(kinds embedded, local, sum, suminproc"
                                          r"\); the fleet has \['sumurl'\]"):
        load_run_config(DEMO, ["engines.in_process=false", 'engines.fleet=[{kind = "sumurl", url = "http://h:1"}]',
                               "rl.update_in_flight=true"])
    # An in-process kind: no rollout process worker, no torchrun; whatever its name.
    inproc = EnginesConfig(fleet=[{"kind": "suminproc"}])
    assert inproc.started_here == 0
    with pytest.raises(ValueError, match="engine of kind 'suminproc' lives in this one"):
        check_engines(inproc, RLTrainingConfig(rollout_worker="process"))
    check_engines(inproc, RLTrainingConfig(update_in_flight=True))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="kind 'suminproc' .*needs a single-process trainer"):
        check_engines(inproc, RLTrainingConfig())
    check_engines(EnginesConfig(fleet=[{"kind": "sum"}]), RLTrainingConfig(rollout_worker="process"))


def _prompts(n: int) -> DataBuffer:
    rng = random.Random(7)
    texts = [f"{rng.randint(0, 50)}+{rng.randint(0, 50)}=" for _ in range(n)]
    return DataBuffer([Prompt(prompt=t, answer=str(eval(t[:-1])), index=i) for i, t in enumerate(texts)],
                      seed=0, shuffle=False)


def test_the_run_launches_builds_closes_and_rolls_out_a_new_kind(new_kinds, tmp_path):
    """engines_for launches the launchable kind's entries through its `launch` (placed, keyed), builds the in-process
    one and closes it, clears the launch options once started; build_engines builds each from its spec; the
    rollout manager generates with them and closes their connections through the declared aclose."""
    cfg = load_run_config(DEMO, ["engines.in_process=false", "engines.threads=3", "seed=11",
                                 'engines.fleet=[{kind = "sum", device = "npu"}, {kind = "sum"}, {kind = "suminproc"}, '
                                 '{kind = "sumurl", url = "http://h:1"}]'])
    with engines_for(cfg, tmp_path, is_main=True, device="cpu") as fleet:
        procs = new_kinds
        assert [p.events for p in procs] == [["launch", "healthy"]] * 2
        assert [p.opts.device for p in procs] == ["npu", "cpu"]  # its own, else placed by the run (no CUDA: cpu)
        assert {(p.opts.model_folder, p.opts.seed, p.opts.threads) for p in procs} == {(str(tmp_path), 11, 3)}
        key = procs[0].opts.api_key
        assert key and procs[1].opts.api_key == key  # a random key, given to each launched engine
        assert [(s.kind, s.url, s.api_key, s.device) for s in fleet[:2]] == [("sum", p.url, key, None) for p in procs]
        inproc = fleet[2]["engine"]
        assert type(inproc) is InProcessSumEngine and inproc.closed == 0
        engines = build_engines(fleet, tmp_path)
        assert [type(e) for e in engines] == [SumEngine, SumEngine, InProcessSumEngine, SumEngine]
        assert [e.url for e in engines] == [procs[0].url, procs[1].url, "inproc://sum", "http://h:1"]
        assert engines[2] is inproc and engines[0].folder == str(tmp_path)
        rollout = dataclasses.replace(cfg.rl.rollout, apply_chat_template=False, rollout_batch_size=8,
                                      n_samples_per_prompt=2, max_new_tokens=4, dynamic_filters=())
        manager = AsyncRolloutManager(engines, rollout, tokenizer=TOK, reward_fn="arithmetic")

        async def one_batch():
            async with manager:
                return await manager.generate_batch(_prompts(16))

        batch = trio.run(one_batch)
    assert [p.events for p in procs] == [["launch", "healthy", "kill"]] * 2 and inproc.closed == 1
    # sample j of a prompt answers a + b + j: the first of each group is right, the second wrong
    groups: dict[int, list[float]] = {}
    for s in batch.samples:
        groups.setdefault(s.metadata["prompt_index"], []).append(s.reward)
    assert len(groups) == 8 and all(sorted(r) == [0.0, 1.0] for r in groups.values())
    generated = [sum(c[0] == "generate" for c in e.calls) for e in engines]
    assert sum(generated) == 8 and all(generated)  # one request per group, round robin over the four
    assert all(("aclose",) in e.calls for e in engines)


# ----------------------------------------------------------------------------------------------- no probes
def _protocol_members() -> set[str]:
    """Every name engines.protocol.InferenceEngine declares (methods and attributes, the weight sync's included)."""
    names: set[str] = set()
    for cls in InferenceEngine.__mro__:
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def engine_probes(source: str, members: set[str]) -> list[str]:
    """getattr / hasattr calls that probe an engine: on an object whose expression names an engine or that a loop
    draws from engines (`for e in self.engines`), or for a name the engine protocol declares (whatever the object)."""
    tree = ast.parse(source)
    drawn = {name.id for node in ast.walk(tree) if isinstance(node, ast.For | ast.comprehension)
             and "engine" in ast.unparse(node.iter).lower() for name in ast.walk(node.target)
             if isinstance(name, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            continue
        target = ast.unparse(node.args[0]).lower()
        name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
        if "engine" in target or target in drawn or name in members:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_check_finds_a_reintroduced_probe():
    members = _protocol_members()
    assert {"generate", "abort", "aclose", "pause_generation", "weight_formats", "url"} <= members
    probes = '''
for engine in self.engines:
    close = getattr(engine, "aclose", None)
bad = [e for e in engines if not all(callable(getattr(e, m, None)) for m in ("generate", "abort"))]
ok = hasattr(e, "load_adapter")
nursery.start_soon(getattr(engine, method))
dtype = getattr(torch, cfg.engines.dtype)
name = getattr(fn, "__name__", None)
'''
    found = engine_probes(probes, members)
    lines = sorted(int(f.split(":")[0].split()[1]) for f in found)
    assert lines == [3, 4, 5, 6], found  # not torch's dtype, not a function's name
    assert any("load_adapter" in f for f in found)


def test_nothing_in_trainer_probes_an_engine():
    members = _protocol_members()
    found = {str(p.relative_to(ROOT)): engine_probes(p.read_text(), members)
             for p in sorted((ROOT / "trainer").rglob("*.py"))}
    assert {p: f for p, f in found.items() if f} == {}


def test_started_engines_serve_the_trainers_compute_dtype(new_kinds, tmp_path, monkeypatch):
    """The embedded engines a run starts load their weights in the dtype the trainer computes in on their device
    (issue 42 item 10: an fp32 trainer on CUDA got bfloat16 engines); [engines] dtype wins."""
    from trainer.run import engine_dtype

    default = load_run_config(DEMO, [])
    fp32 = load_run_config(DEMO, ['trainer.param_dtype="float32"'])
    assert (engine_dtype(default, "cpu"), engine_dtype(default, "cuda:1")) == ("float32", "bfloat16")
    assert engine_dtype(fp32, "cuda:0") == "float32"
    assert engine_dtype(load_run_config(DEMO, ['engines.dtype="float16"']), "cuda") == "float16"
    built = []

    def build_engine(spec, **kw):
        built.append(kw)
        return InProcessSumEngine("inproc://sum", str(tmp_path))

    monkeypatch.setattr(registry, "build_engine", build_engine)
    for dtype in ("float32", "bfloat16"):
        cfg = load_run_config(DEMO, ["engines.in_process=false", f'trainer.param_dtype="{dtype}"',
                                     'engines.fleet=[{kind = "sum"}, {kind = "suminproc"}]'])
        new_kinds.clear()
        with engines_for(cfg, tmp_path, is_main=True, device="cpu"):
            assert [p.opts.dtype for p in new_kinds] == [dtype]
        assert built[-1]["dtype"] == dtype and built[-1]["share_stream"] is False  # the CPU: no stream to share
    # On CUDA, in synchronous RL, the in-process engine generates on the trainer's compute stream; not in async RL.
    for async_rollout, shares in ((False, True), (True, False)):
        cfg = load_run_config(DEMO, ["engines.in_process=false", 'engines.fleet=[{kind = "suminproc"}]',
                                     f"rl.async_rollout={str(async_rollout).lower()}"])
        with engines_for(cfg, tmp_path, is_main=True, device="cuda:0"):
            pass
        assert built[-1]["share_stream"] is shares and built[-1]["dtype"] == "bfloat16"
    # The embedded kind hands it to its process.
    proc = registry.ENGINE_KINDS["embedded"].launch(registry.EngineSpec("embedded"),
                                                    registry.LaunchOptions("tiny", api_key="k", dtype="float32"))
    assert proc.extra_args[-2:] == ("--dtype", "float32")
