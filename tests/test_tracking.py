"""Tracking backends (trainer/tracking.py): the same metrics reach metrics.jsonl, the TensorBoard event file and the
offline W&B run file, read back from disk; tables; a resumed TensorBoard writer; missing packages; closing."""

import json
import random
from importlib.util import find_spec

import numpy as np
import pytest
from tracking_support import (
    read_tensorboard_text,
    read_wandb_records,
    wandb_config,
    wandb_history,
    wandb_run_file,
    wandb_run_info,
)

import trainer.tracking as tracking
from trainer.config import ConfigError, LoggingConfig
from trainer.metrics import JSONLLogger, read_jsonl
from trainer.tracking import (
    MultiLogger,
    TensorBoardLogger,
    build_logger,
    check_backends,
    read_tensorboard_scalars,
    wandb_mode,
)

# tensorboard and wandb are the optional extra `tracking` (make test installs it)
needs_tracking = pytest.mark.skipif(find_spec("tensorboard") is None or find_spec("wandb") is None,
                                    reason="needs the tracking extra: pip install -e '.[tracking]'")

STEPS = range(1, 6)
CONFIG_TEXT = 'name = "demo"\nseed = 3\n\n[rl]\nnum_steps = 5\n'
CONFIG = {"name": "demo", "seed": 3, "rl": {"num_steps": 5, "optim": {"lr": 1.5e-6}}}
TABLE_STEP = 3


def _metrics(rng: random.Random) -> dict:
    """One step's metrics as a loop logs them: floats, ints, a bool, names with slashes, and text (JSONL only)."""
    return {"loss": rng.uniform(-2, 2), "grad_norm": rng.lognormvariate(0, 1),
            "rollout/reward_mean": rng.random(), "rollout/num_tokens": rng.randrange(1, 10_000),
            "eval/heldout/pass@4": rng.random(), "timing/generate_s": rng.expovariate(3.0),
            "rollout/truncated": rng.random() < 0.5, "note": f"text-{rng.randrange(100)}"}


def _numeric(metrics: dict) -> dict:
    return {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items() if not isinstance(v, str)}


def _table(rng: random.Random) -> list[dict]:
    # completions hold newlines and pipes; a row may lack a key
    rows = [{"prompt": f"What is {rng.randrange(100)} + {rng.randrange(100)}?", "completion": f"a | b\nc {i}",
             "reward": rng.random(), "tokens": rng.randrange(1, 500), "status": "ok"} for i in range(3)]
    del rows[1]["status"]
    return rows


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One RL phase logged through build_logger to all three backends (W&B offline, no key), then closed."""
    tmp = tmp_path_factory.mktemp("tracked")
    rng = random.Random(2025)
    logged = {step: _metrics(rng) for step in STEPS}
    rows = _table(rng)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("WANDB_API_KEY", raising=False)
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # keep wandb's staging out of $HOME
            mp.setenv(var, str(tmp / "wandb-home" / var.lower()))
        cfg = LoggingConfig(backends=("jsonl", "tensorboard", "wandb"), project="rlk-test")
        logger = build_logger(cfg, phase="rl", phase_dir=tmp / "rl", run_dir=tmp, run_name="demo",
                              config_text=CONFIG_TEXT, config=CONFIG, enabled=True, keep_through=0)
        for step, metrics in logged.items():
            logger.log(step, metrics)
            if step == TABLE_STEP:
                logger.log_table(step, "rollouts/samples", rows)
        logger.close()
    return tmp, logged, rows


@needs_tracking
def test_every_backend_gets_every_metric_at_every_step(tracked_run):
    tmp, logged, _ = tracked_run

    jsonl = read_jsonl(tmp / "rl" / "metrics.jsonl")
    assert [row["step"] for row in jsonl] == list(STEPS)
    for row in jsonl:
        assert {k: row[k] for k in logged[row["step"]]} == logged[row["step"]]

    scalars = read_tensorboard_scalars(tmp / "tensorboard" / "rl")
    assert set(scalars) == set(_numeric(logged[1]))
    for tag, points in scalars.items():
        assert [s for s, _ in points] == list(STEPS), tag
        # add_scalar stores float32: the read-back value is the logged one rounded to float32, exactly
        assert [v for _, v in points] == [float(np.float32(logged[s][tag])) for s in STEPS], tag
    assert CONFIG_TEXT.strip() in read_tensorboard_text(tmp / "tensorboard" / "rl")["config"][0][1]

    records = read_wandb_records(wandb_run_file(tmp))
    assert wandb_run_info(records) == {"project": "rlk-test", "name": "demo-rl", "group": "demo"}
    assert wandb_config(records) == CONFIG
    history = wandb_history(records)
    assert [row["_step"] for row in history] == list(STEPS)
    for row in history:
        expected = _numeric(logged[row["_step"]])
        assert {k: row[k] for k in expected} == expected  # W&B writes float64 as JSON: exact
        assert "note" not in row


@needs_tracking
def test_tables_reach_wandb_and_tensorboard(tracked_run):
    tmp, _, rows = tracked_run

    (row,) = [r for r in wandb_history(read_wandb_records(wandb_run_file(tmp))) if "rollouts/samples/_type" in r]
    assert row["_step"] == TABLE_STEP and row["rollouts/samples/_type"] == "table-file"
    assert row["rollouts/samples/nrows"] == len(rows)
    table = json.loads((wandb_run_file(tmp).parent / "files" / row["rollouts/samples/path"]).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "tokens", "status"]
    expected = [[r["prompt"], r["completion"], r["reward"], float(r["tokens"]), r.get("status")] for r in rows]
    assert table["data"] == expected

    ((step, text),) = read_tensorboard_text(tmp / "tensorboard" / "rl")["rollouts/samples"]
    lines = text.splitlines()
    assert step == TABLE_STEP and lines[0] == "| prompt | completion | reward | tokens | status |"
    assert len(lines) == 2 + len(rows)
    for line, r in zip(lines[2:], rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells == [r["prompt"], "a \\| b<br>c " + r["completion"][-1], str(r["reward"]), str(r["tokens"]),
                         r.get("status", "")]


def test_disabled_rank_builds_only_the_disabled_jsonl_logger(tmp_path):
    cfg = LoggingConfig(backends=("jsonl", "tensorboard", "wandb"))
    logger = build_logger(cfg, phase="sft", phase_dir=tmp_path / "sft", run_dir=tmp_path, run_name="demo",
                          config_text=CONFIG_TEXT, config=CONFIG, enabled=False, keep_through=0)
    logger.log(1, {"loss": 1.0})
    logger.log_table(1, "t", [{"a": 1}])
    logger.close()
    assert [type(lg) for lg in logger.loggers] == [JSONLLogger] and list(tmp_path.iterdir()) == []


@needs_tracking
def test_resumed_tensorboard_writer_drops_the_steps_past_the_checkpoint(tmp_path):
    rng = np.random.default_rng(7)
    first, second = rng.normal(size=5), rng.normal(size=5)
    writer = TensorBoardLogger(tmp_path, keep_through=0)
    for step in range(1, 5):  # the first attempt died after logging step 4; its checkpoint is step 2
        writer.log(step, {"loss": float(first[step]), "eval/heldout/accuracy": float(first[step]) / 2})
    writer.close()
    writer = TensorBoardLogger(tmp_path, keep_through=2)
    for step in range(3, 6):
        writer.log(step, {"loss": float(second[step - 1]), "eval/heldout/accuracy": float(second[step - 1]) / 2})
    writer.close()

    expected = [float(first[1]), float(first[2]), *(float(second[s - 1]) for s in range(3, 6))]
    scalars = read_tensorboard_scalars(tmp_path)
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars["loss"]] == [float(np.float32(v)) for v in expected]
    assert [v for _, v in scalars["eval/heldout/accuracy"]] == [float(np.float32(v / 2)) for v in expected]


@needs_tracking
@pytest.mark.parametrize("missing", ["tensorboard", "wandb"])
def test_a_missing_backend_package_is_a_config_error(monkeypatch, tmp_path, missing):
    check_backends(("jsonl", "tensorboard", "wandb"))  # both installed here (the tracking extra)
    real = tracking.find_spec
    monkeypatch.setattr(tracking, "find_spec", lambda name: None if name == missing else real(name))
    check_backends(("jsonl", *{"tensorboard", "wandb"} - {missing}))
    with pytest.raises(ConfigError, match=rf'\[logging\] backends: "{missing}" needs the {missing} package: '
                                          rf"pip install 'rlkernels\[tracking\]' \(or pip install {missing}\)"):
        check_backends(("jsonl", missing))
    with pytest.raises(ConfigError, match=missing):  # build_logger checks first, before it opens anything
        build_logger(LoggingConfig(backends=("jsonl", missing)), phase="rl", phase_dir=tmp_path / "rl",
                     run_dir=tmp_path, run_name="demo", config_text="", config={}, enabled=True, keep_through=0)
    assert list(tmp_path.iterdir()) == []


def test_wandb_mode(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"  # no key anywhere
    (tmp_path / "netrc").write_text("machine example.com login user password other\n")
    assert wandb_mode() == "offline"  # a netrc without the W&B host
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode() == "offline"  # the key is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # WANDB_MODE wins


class _Recorder:
    def __init__(self, name, calls, fail=False, tables=False):
        self.name, self.calls, self.fail = name, calls, fail
        if tables:
            self.log_table = lambda step, name, rows: calls.append((self.name, "table", step, name))

    def log(self, step, metrics):
        self.calls.append((self.name, "log", step))

    def close(self):
        self.calls.append((self.name, "close"))
        if self.fail:
            raise RuntimeError(f"{self.name} failed to close")


def test_multilogger_fans_out_and_closes_every_logger(tmp_path):
    calls = []
    jsonl = JSONLLogger(tmp_path / "metrics.jsonl")
    loggers = [_Recorder("a", calls, fail=True, tables=True), jsonl, _Recorder("b", calls),
               _Recorder("c", calls, fail=True, tables=True)]
    multi = MultiLogger(loggers)
    multi.log(4, {"loss": 0.25})
    multi.log_table(4, "rollouts/samples", [{"reward": 1.0}])  # JSONLLogger and b show no tables: skipped
    with pytest.raises(RuntimeError, match="a failed to close") as err:
        multi.close()
    assert "c failed to close" in "".join(err.value.__notes__)
    assert calls == [("a", "log", 4), ("b", "log", 4), ("c", "log", 4), ("a", "table", 4, "rollouts/samples"),
                     ("c", "table", 4, "rollouts/samples"), ("a", "close"), ("b", "close"), ("c", "close")]
    jsonl.log(5, {"loss": 0.5})  # closed: writes nothing
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25]


def test_build_logger_closes_what_it_opened_when_a_backend_fails(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(tracking, "TensorBoardLogger", lambda *a, **kw: _Recorder("tensorboard", calls))

    def no_network(**kw):
        raise ConnectionError("wandb.init: no network")

    monkeypatch.setattr(tracking, "WandbLogger", no_network)
    with pytest.raises(ConnectionError, match="no network"):
        build_logger(LoggingConfig(backends=("jsonl", "tensorboard", "wandb")), phase="rl", phase_dir=tmp_path,
                     run_dir=tmp_path, run_name="demo", config_text="", config={}, enabled=True, keep_through=0)
    assert calls == [("tensorboard", "close")]
