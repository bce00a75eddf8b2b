"""[logging] profile_steps: torch.profiler over a window of a phase's steps (trainer/profiling.py).

- The window is exactly the steps asked for: an op run inside it is in the trace and the tables, ops run before
  and after it are not; a resumed phase starting inside the window traces the rest of it; a phase that ends inside
  it writes what it traced.
- The key is validated with a message naming it; an SFT phase through the tracking loggers writes the trace with its
  "sft.train" ranges (the RL loop labels rl.generate / rl.train / rl.sync the same way).
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from trainer.config import LoggingConfig, RunConfig, config_from_dict
from trainer.profiling import StepProfiler


def _events(trace_path) -> list[dict]:
    with gzip.open(trace_path, "rt") as f:
        return json.load(f)["traceEvents"]


def _names(trace_path) -> set[str]:
    return {e.get("name", "") for e in _events(trace_path)}


def _run_steps(profiler: StepProfiler, steps: range, marker_of) -> None:
    """Each step runs its marker op, then is logged (what a training loop does)."""
    x = torch.randn(64, 64)
    for step in steps:
        marker_of(step)(x)
        profiler.log(step, {"loss": 0.0})


def test_the_window_holds_exactly_its_steps(tmp_path):
    # step 1 and 4 run cummax (outside), steps 2 and 3 cumprod (inside [2, 3])
    inside, outside = torch.cumprod, torch.cummax
    profiler = StepProfiler(2, 3, tmp_path / "profile")
    assert profiler.prof is None  # starts once step 1 is logged
    _run_steps(profiler, range(1, 5),
               lambda s: (lambda x: inside(x, 0)) if s in (2, 3) else (lambda x: outside(x, 0)))
    profiler.close()
    assert profiler.traced == [2, 3]
    trace, table = tmp_path / "profile" / "steps_2-3.trace.json.gz", tmp_path / "profile" / "steps_2-3.txt"
    assert profiler.written == [trace, table]
    names = _names(trace)
    assert "aten::cumprod" in names and "aten::cummax" not in names
    text = table.read_text()
    assert text.startswith("steps [2, 3] of [2, 3] traced:") and "by self CPU time:" in text
    assert "aten::cumprod" in text and "aten::cummax" not in text


def test_a_resumed_or_short_phase_traces_what_falls_in_the_window(tmp_path):
    # resumed after step 3 of a [2, 5] window: tracing from the start, steps 4 and 5
    resumed = StepProfiler(2, 5, tmp_path / "a", start_after=3)
    assert resumed.prof is not None
    _run_steps(resumed, range(4, 7), lambda s: (lambda x: torch.cumsum(x, 0)) if s <= 5 else (lambda x: x.sort()))
    resumed.close()
    assert resumed.traced == [4, 5]
    names = _names(tmp_path / "a" / "steps_2-5.trace.json.gz")
    assert "aten::cumsum" in names and "aten::sort" not in names
    # a phase of 2 steps under a [2, 3] window: step 2 traced, written when the phase closes its loggers
    short = StepProfiler(2, 3, tmp_path / "b")
    _run_steps(short, range(1, 3), lambda s: lambda x: torch.cumsum(x, 0))
    assert short.prof is not None and short.written == []
    short.close()
    assert short.traced == [2] and (tmp_path / "b" / "steps_2-3.txt").read_text().startswith("steps [2] of [2, 3]")
    # a finished phase resumed inside its window (4 steps, [2, 5]): it traces no step and keeps the earlier trace
    again = StepProfiler(2, 5, tmp_path / "a", start_after=4)
    assert again.prof is not None
    again.close()
    assert again.written == [] and "aten::cumsum" in _names(tmp_path / "a" / "steps_2-5.trace.json.gz")
    # resumed past the window: nothing runs, nothing is written
    past = StepProfiler(2, 3, tmp_path / "c", start_after=3)
    _run_steps(past, range(4, 6), lambda s: lambda x: torch.cumsum(x, 0))
    past.close()
    assert past.prof is None and past.written == [] and not (tmp_path / "c").exists()


def test_a_trace_that_cannot_be_written_is_a_warning(tmp_path):
    (tmp_path / "profile").write_text("a file where the folder would go")
    profiler = StepProfiler(1, 1, tmp_path / "profile")
    with pytest.warns(RuntimeWarning, match=r"profile_steps: writing the trace of steps \[1\].*the run goes on"):
        _run_steps(profiler, range(1, 3), lambda s: lambda x: torch.cumsum(x, 0))
    assert profiler.prof is None and profiler.written == []


@pytest.mark.parametrize("steps, message", [([3], "two steps"), ([0, 2], "1 <= first"), ([4, 2], "first <= last"),
                                            ([1.5, 2], "two steps"), ([True, 2], "two steps")])
def test_bad_windows_are_named(steps, message):
    with pytest.raises(ValueError, match=rf"profile_steps.*{message}"):
        LoggingConfig(profile_steps=tuple(steps))
    assert config_from_dict(RunConfig, {"logging": {"profile_steps": [2, 3]}}).logging.profile_steps == (2, 3)


def test_an_sft_phase_writes_its_trace_through_the_tracking_loggers(tmp_path):
    """run_sft_training with the phase's loggers from trainer.tracking.build_logger (what the CLI builds):
    steps [2, 3] of 4 traced, the "sft.train" range of each step in the trace, the metrics still logged."""
    from engines.tiny import build_tokenizer, tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import trainer_config_from
    from trainer.config import OptimConfig, SFTTrainingConfig
    from trainer.sft import run_sft_training
    from trainer.tracking import build_logger

    chats = [[{"role": "user", "content": f"{i}+{i}="}, {"role": "assistant", "content": str(2 * i)}]
             for i in range(16)]
    cfg = SFTTrainingConfig(optim=OptimConfig(lr=1e-3), num_steps=4, batch_size=4, max_length=32, token_budget=128,
                            micro_batch_buckets=16, output_dir=str(tmp_path / "sft"), seed=0)
    logging_cfg = LoggingConfig(profile_steps=(2, 3))

    def open_logger(keep_through: int):
        return build_logger(logging_cfg, phase="sft", phase_dir=tmp_path / "sft", run_dir=tmp_path, run_name="t",
                            config_text="", config={}, enabled=True, keep_through=keep_through)

    with use_backend("torch"):
        _, state, hist = run_sft_training(tiny_model_config(), chats, cfg, tokenizer=build_tokenizer(),
                                          trainer_config=trainer_config_from(cfg, compile=False), logger=open_logger)
    assert state.step == 4 and len(hist) == 4
    events = _events(tmp_path / "sft" / "profile" / "steps_2-3.trace.json.gz")
    ranges = [e for e in events if e.get("name") == "sft.train" and e.get("ph") == "X"]
    assert len(ranges) == 2  # steps 2 and 3, not 1 or 4
    assert (tmp_path / "sft" / "profile" / "steps_2-3.txt").read_text().startswith("steps [2, 3] of [2, 3]")
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
