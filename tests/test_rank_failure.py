"""Under torchrun, a rollout that fails on rank 0 reaches every rank: no rank is left waiting in the batch
broadcast, every rank writes its checkpoint shard, and every rank exits non-zero with the error.

The test runs this file as the torchrun entry point (2 gloo ranks on CPU):

    torchrun --nproc-per-node 2 tests/test_rank_failure.py <output_dir> <failing_step>

Rank 0 drives rollouts on an in-process engine that answers with random digit tokens and raises on the request
of step <failing_step>; weight sync is a no-op (the engine holds no weights).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_support import cpu_child_env

ROOT = Path(__file__).resolve().parents[1]
NUM_STEPS, BATCH, N = 4, 2, 2  # steps asked for; groups per step; samples per group


class FlakyEngine:
    """An InferenceEngine whose generate answers `good_requests` requests, then raises (the engine died)."""

    url = "fake://flaky"

    def __init__(self, good_requests: int, vocab: list[int], seed: int = 0) -> None:
        self.good_requests = good_requests
        self.vocab = vocab
        self.calls = 0
        self.gen = torch.Generator().manual_seed(seed)

    async def health(self) -> bool:
        return True

    async def generate(self, prompts, params, *, rids=None):
        from engines.protocol import Completion, EngineError

        self.calls += 1
        if self.calls > self.good_requests:
            raise EngineError(f"{self.url}: the engine process died (request {self.calls})")
        out = []
        for p in prompts:
            row = []
            for _ in range(params.n):
                pick = torch.randint(len(self.vocab), (params.max_new_tokens,), generator=self.gen).tolist()
                ids = [self.vocab[i] for i in pick]
                row.append(Completion(output_ids=ids, logprobs=[-2.3] * len(ids), finish_reason="length",
                                      weight_version=0, prompt_ids=list(p)))
            out.append(row)
        return out

    async def abort(self, rids=None) -> None:
        return None

    async def aclose(self):  # engines.protocol.InferenceEngine: nothing pooled
        pass


class NoSync:
    """Stands in for the weight-sync sender: the fake engine has no weights to receive."""

    weight_version = 0
    last_sync_bytes = 0  # what the RL loop logs as sync/bytes

    def sync(self, weight_version: int) -> None:
        self.weight_version = weight_version


def _worker(output_dir: str, failing_step: int) -> None:
    from engines.tiny import build_tokenizer, tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, init_distributed, trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
    from trainer.data.buffer import DataBuffer, load_jsonl
    from trainer.rl import run_rl_training

    torch.set_num_threads(1)
    tok = build_tokenizer()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0), num_steps=NUM_STEPS, token_budget=128,
                           micro_batch_buckets=32, loss={"loss_agg": "token-mean"}, output_dir=output_dir,
                           rollout=RolloutConfig(apply_chat_template=False,
                                                 rollout_batch_size=BATCH, n_samples_per_prompt=N, max_new_tokens=4,
                                                 max_retries=0, seed=3))
    tcfg = trainer_config_from(cfg, compile=False)
    with use_backend("torch"):
        comp = build_components(tiny_model_config("llama"), tcfg, mesh=init_distributed("cpu"))
        # One request per group (n samples of one prompt): steps before `failing_step` are answered.
        engine = FlakyEngine((failing_step - 1) * BATCH, digits)
        buffer = DataBuffer(load_jsonl(str(ROOT / "data/arithmetic_train.jsonl")), seed=0)
        run_rl_training(None, buffer, cfg, engines=[engine], sender=NoSync(), tokenizer=tok,
                        reward_fn=lambda s: sum(t in digits[:5] for t in s.tokens[s.prompt_length:]) / 4,
                        trainer_config=tcfg, components=comp)


@pytest.mark.distributed
def test_rollout_failure_on_rank0_reaches_every_rank_and_checkpoints(tmp_path):
    from engines.embedded.launch import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = tmp_path / "run"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--tee", "3",
           "--log-dir", str(tmp_path / "logs"), __file__, str(out), "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_child_env([str(ROOT)]), capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    # Each rank's own exit status and error (torchrun keeps a log per rank).
    errors = {}
    for rank in (0, 1):
        err = next((tmp_path / "logs").rglob(f"attempt_0/{rank}/stderr.log")).read_text()
        errors[rank] = err
        assert "Traceback" in err, f"rank {rank} did not raise:\n{err[-2000:]}"
    # Step 2's requests (3 and 4) run concurrently and both fail; rank 0 raises the first it sees.
    first = re.search(r"EngineError: fake://flaky: the engine process died \(request [34]\)", errors[0])
    assert first, errors[0][-2000:]
    assert f"RunStopped: the rollout on rank 0 failed at step 2: {first.group(0)}" in errors[1]
    assert "exitcode" in log and "the engine process died" in log
    # A complete checkpoint of step 1 (the last trained step), with both ranks' shards, that loads back.
    ckpt = out / "checkpoints" / "step_00000001"
    meta = json.loads((ckpt / "state.json").read_text())
    assert meta["state"]["step"] == 1 and meta["world_size"] == 2
    assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / "rng_rank1.pt").is_file()
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert meta["extra"]["rollout_manager"]["group_uid"] >= BATCH  # rank 0's rollout state, not a blank one
    assert not list((out / "checkpoints").glob("step_00000002"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    _worker(sys.argv[1], int(sys.argv[2]))
