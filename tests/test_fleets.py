"""Fleets in the run config: [engines].fleet validation and the older forms, engine objects per kind, and one RL
step through the CLI with two engines of different kinds (an embedded engine started by the run + one addressed
by URL as kind "sglang"), by the weight-update group and by the disk fallback."""

import json
from pathlib import Path

import pytest
import trio
from fleet_support import config_with_engines, run_one_rl_step

from engines.embedded.launch import EngineProcess
from engines.registry import EngineSpec
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from trainer.cli import ConfigError, build_engines, load_run_config, prepare_model_folder
from trainer.config import EnginesConfig


@pytest.mark.parametrize("engines_toml,message", [
    ('fleet = [{kind = "trt"}]', "kind = 'trt'"),
    ('fleet = [{kind = "sglang"}]', "needs a url"),
    ('fleet = [{url = "host:1", kind = "vllm"}]', "http"),
    ('fleet = [{url = "http://h:1", kind = "sglang", tp_size = 0}]', "tp_size"),
    ('fleet = [{url = "http://h:1", port = 3}]', r"unknown config key\(s\) \['port'\] in \[engines.fleet\[0\]\]"),
    ('fleet = [{kind = "embedded", tp_size = 2}]', "one device"),
    ('fleet = "http://h:1"', "list of tables"),
    ('urls = ["http://h:1"]', r"engines\.urls moved to \[engines\] fleet, one table per server"),
    ('embedded = 2', r"engines\.embedded moved to \[engines\] fleet, one table per engine the run starts"),
    ('in_process = true\nfleet = [{kind = "embedded"}]', "in_process = true and \\[engines\\].fleet both given"),
    ('sync = "nfs"', "'group'"),
    ('master_port = 70000', "master_port"),
])
def test_bad_fleets_are_named(tmp_path, engines_toml, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(config_with_engines(tmp_path, engines_toml))


def test_fleet_forms_and_engine_objects(tmp_path):
    urls = load_run_config(config_with_engines(tmp_path, 'fleet = [{url = "http://a:1"}, {url = "http://b:2"}]'))
    assert urls.engines.fleet == (EngineSpec(url="http://a:1", kind="sglang", tp_size=1, model=None),
                                  EngineSpec(url="http://b:2", kind="sglang", tp_size=1, model=None))
    assert EnginesConfig(in_process=True).fleet == (EngineSpec("local"),) and EnginesConfig().fleet == (
        EngineSpec("embedded"),)
    cfg = load_run_config(config_with_engines(tmp_path, '''
fleet = [{url = "http://a:1", kind = "sglang", tp_size = 4}, {url = "http://b:2", kind = "vllm", model = "m"},
         {kind = "embedded"}, {url = "http://c:3", kind = "embedded"}]
sync = "disk"
master_address = "10.0.0.5"
'''))
    fleet = list(cfg.engines.fleet)
    assert [t.url for t in fleet] == ["http://a:1", "http://b:2", None, "http://c:3"]
    assert [t.tp_size for t in fleet] == [4, 1, 1, 1] and fleet[1].model == "m"
    assert cfg.engines.sync == "disk" and cfg.engines.master_address == "10.0.0.5"
    fleet[2] = EngineSpec("embedded", url="http://d:4")
    engines = build_engines(fleet, Path("/models/x"))
    assert [type(e) for e in engines] == [SGLangEngine, VLLMEngine, SGLangEngine, SGLangEngine]
    assert trio.run(engines[0].world_size) == 4  # the configured tp_size: 4 ranks in the group, no server asked
    assert engines[1].model == "m" and engines[1].url == "http://b:2"


def _run_rl(tmp_path, sync: str):
    """One RL step with an embedded engine started by the run and one more addressed by URL as kind "sglang"."""
    name = f"fleet_{sync}"
    probe_cfg = load_run_config(config_with_engines(tmp_path, 'fleet = [{kind = "embedded"}]', name=name))

    folder = prepare_model_folder(probe_cfg)  # the run reuses this folder (same output_dir)
    with EngineProcess(str(folder), seed=0, device="cpu") as remote:  # float32 on the CPU, as the run's trainer
        cfg = config_with_engines(tmp_path, f'''
fleet = [{{kind = "embedded"}}, {{url = "{remote.url}", kind = "sglang", tp_size = 1}}]
sync = "{sync}"
threads = 1
''', name=name)
        proc = run_one_rl_step(cfg)
        info = trio.run(SGLangEngine(remote.url).get_server_info)
    out = tmp_path / name
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # the training step (step 0 holds the evaluation before RL)
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 1 and len(rows) == 1
    assert rows[0]["verify_sync_max_abs_diff"] <= 1e-5  # both engines serve the trainer's weights after the sync
    assert info["weight_version"] == str(rows[0]["weight_version"]) == "1"  # the URL engine got the sync
    assert info["decode_steps"] > 0  # and served rollouts or evaluation
    return proc


def test_rl_step_with_two_engine_kinds_by_group(tmp_path):
    proc = _run_rl(tmp_path, "group")
    assert "disk fallback" not in proc.stdout


def test_rl_step_with_two_engine_kinds_by_disk(tmp_path):
    proc = _run_rl(tmp_path, "disk")
    assert "weight sync: disk fallback" in proc.stdout  # opt-in and logged


def test_engine_placement_counts_the_ranks_of_this_host():
    """Two nodes of 8 GPUs, 4 ranks each (torchrun: WORLD_SIZE=8, LOCAL_WORLD_SIZE=4): an engine started on a node
    goes to that node's cuda:4, where WORLD_SIZE would count 8 ranks on it and find no free GPU."""
    from trainer.run import engine_devices, trainer_ranks_here

    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    assert trainer_ranks_here(env) == 4
    assert engine_devices([None, None], trainer_device="cuda:0", local_world_size=trainer_ranks_here(env),
                          cuda_count=8) == ["cuda:4", "cuda:5"]
    assert trainer_ranks_here({"WORLD_SIZE": "3"}) == 3  # a launcher without LOCAL_WORLD_SIZE: one node assumed
    assert trainer_ranks_here({}) == 1
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='four'"):
        trainer_ranks_here({"LOCAL_WORLD_SIZE": "four"})


def test_engines_the_run_starts_are_placed_by_device():
    """One process shares its GPU with its engines; torchrun ranks leave the GPUs past this host's ranks to the
    engines (round robin); a fleet entry's device wins; no free GPU is an error naming the fix; no CUDA: the CPU."""
    from trainer.run import engine_devices

    assert engine_devices([None, None], trainer_device="cpu", local_world_size=1, cuda_count=0) == ["cpu", "cpu"]
    assert engine_devices([None], trainer_device="cuda:0", local_world_size=1, cuda_count=8) == ["cuda:0"]
    assert engine_devices([None, None, None], trainer_device="cuda:0", local_world_size=6, cuda_count=8) == [
        "cuda:6", "cuda:7", "cuda:6"]
    assert engine_devices([None, "cuda:3"], trainer_device="cuda:0", local_world_size=4, cuda_count=8) == [
        "cuda:4", "cuda:3"]
    assert engine_devices(["cuda:1"], trainer_device="cuda:0", local_world_size=8, cuda_count=8) == ["cuda:1"]
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 7"):
        engine_devices([None], trainer_device="cuda:0", local_world_size=8, cuda_count=8)
    with pytest.raises(ValueError, match="only an \"embedded\" engine the run starts"):
        EngineSpec("sglang", url="http://127.0.0.1:1", device="cuda:1")
    with pytest.raises(ValueError, match="cuda:N"):
        EngineSpec("embedded", device="gpu1")
    # The engine process is told its device on its command line.
    proc = EngineProcess("tiny", device="cpu")
    try:
        proc.launch()
        assert proc.proc.args[proc.proc.args.index("--device") + 1] == "cpu"
    finally:
        proc.kill()
    cfg = load_run_config(Path(__file__).resolve().parents[1] / "configs" / "demo.toml",
                          ["engines.in_process=false", 'engines.fleet=[{kind = "embedded", device = "cpu"}]'])
    assert cfg.engines.fleet[0].device == "cpu"
