"""How many graphs the compiled trainer's blocks trace, and what its first steps take (issue 42: the compiles a
cold GPU run pays before its first steps).

    python bench/compile_counts.py [--backend inductor|aot_eager] [--steps 10]

Runs SFT steps of 1-3 random sequences (4-119 tokens each) over the tiny preset with [trainer] compile on, packed to
rows of a 128-token budget in 32-token buckets, so the rows' lengths change step to step and some hold a single
sequence. Prints one JSON line: dynamo's graph and graph-break counts, the attn_implementation, whether each row
held one sequence, each step's wall time and loss. Run it with a fresh TORCHINDUCTOR_CACHE_DIR to time cold
compiles; the tests count the graphs with it (tests/test_trainer_core.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.tiny import tiny_model_config  # noqa: E402
from trainer.backend.attention import _attn_implementation  # noqa: E402
from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from  # noqa: E402
from trainer.batching.micro_batches import build_micro_batches  # noqa: E402
from trainer.config import OptimConfig, SFTTrainingConfig  # noqa: E402
from trainer.types import Sample, TrainingState  # noqa: E402

BUDGET, BUCKET = 128, 32


def compiled_steps(backend: str, steps: int = 10) -> dict:
    """`steps` SFT steps over compiled blocks from a fresh dynamo cache -> graphs, attn_implementation, the rows'
    lengths, whether each row held a single sequence, per-step seconds and losses."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sft = SFTTrainingConfig(token_budget=BUDGET, micro_batch_buckets=BUCKET, optim=OptimConfig(lr=1e-3))
    comp = build_components(tiny_model_config(), trainer_config_from(sft, compile=True, compile_backend=backend))
    state, lengths, singles, seconds, losses = TrainingState(), set(), set(), [], []
    for step in range(steps):
        t = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        n = int(torch.randint(1, 4, (), generator=g))
        samples = [Sample(prompt="", tokens=torch.randint(6, 90, (int(torch.randint(4, 120, (), generator=g)),),
                                                          generator=g).tolist(), response_length=3)
                   for _ in range(n)]
        mbs = build_micro_batches(samples, token_budget=BUDGET, bucket_size=BUCKET)
        lengths |= {mb.row.padded_len for mb in mbs}
        singles |= {sum(1 for k in mb.row.lengths if k > 0) == 1 for mb in mbs}
        fut = forward_backward(comp, mbs)
        _, state = optim_step(comp, state, num_tokens=fut.num_tokens)
        losses.append(fut.result()["loss"])
        seconds.append(round(time.perf_counter() - t, 2))
    assert all(math.isfinite(x) for x in losses), losses
    return {"backend": backend, "device": str(next(comp.model.parameters()).device.type),
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "attn_implementation": _attn_implementation(comp.model),
            "row_lengths": sorted(lengths), "single_sequence_rows": sorted(singles), "step_s": seconds,
            "total_s": round(sum(seconds), 1), "losses": [round(x, 6) for x in losses]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(json.dumps(compiled_steps(args.backend, args.steps)))


if __name__ == "__main__":
    main()
