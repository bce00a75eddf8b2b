"""After a sync: do the engines' log-probs equal the trainer's, and do they serve the expected version?"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engines.protocol import InferenceEngine
from trainer.weight_sync.common import EngineCalls, from_rank0, trainer_rank


@dataclass(frozen=True)
class VerifyResult:
    """max |engine log-prob - trainer log-prob| per engine over the probe tokens, and the versions engines report."""

    max_abs_diff: tuple[float, ...]
    versions: tuple[int, ...]
    expected_version: int
    tol: float

    @property
    def ok(self) -> bool:
        return all(d <= self.tol for d in self.max_abs_diff) and all(v == self.expected_version
                                                                        for v in self.versions)


# fp32 both sides: the only difference is batched/cached vs one-shot attention arithmetic. bf16: one bf16 rounding
# of logits-scale values (~2^-8 relative at |logit| ~ 10) dominates.
VERIFY_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def verify_tolerance(*dtypes: torch.dtype) -> float:
    """The loosest tolerance among the dtypes that computed the two sides' logits."""
    return max(VERIFY_TOL.get(d, 5e-2) for d in dtypes)


def verify_sync(model: nn.Module, engines: Sequence[InferenceEngine], probe_prompts: Sequence[Sequence[int]], *,
                expected_version: int, max_new_tokens: int = 8, tol: float | None = None,
                engine_dtype: torch.dtype | None = None) -> VerifyResult:
    """Generate greedily from `probe_prompts` on every engine, recompute the log-prob of each generated token with
    the trainer's model, compare. Call on every trainer rank (an FSDP2 forward is collective); rank 0 asks the
    engines and shares their answers over the trainer's default group.

    tol None: from the compute dtypes, the dtype the trainer's forward produced its logits in (bf16 under FSDP2
    mixed precision even with fp32 parameters) and `engine_dtype` when given."""
    from engines.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    answers = None
    if trainer_rank() == 0:
        calls = EngineCalls(engines, lambda i, eng: eng.generate([list(p) for p in probe_prompts], params),
                           "generate")
        answers = calls.join(300.0, "verify_sync generate")
        answers = [[[(c.output_ids, c.logprobs, c.weight_version) for c in group] for group in per_engine]
                   for per_engine in answers]
    answers = from_rank0(answers)
    diffs, versions, compute = [], [], set()
    device = next(model.parameters()).device
    with torch.no_grad():
        for per_engine in answers:
            worst = 0.0
            for prompt, group in zip(probe_prompts, per_engine):
                ids, lps, version = group[0]
                versions.append(version)
                seq = torch.tensor([list(prompt) + ids], device=device)
                logits = model(input_ids=seq).logits
                compute.add(logits.dtype)
                logits = logits.float()[0, len(prompt) - 1:-1]
                ours = logits.log_softmax(-1).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
                worst = max(worst, (ours.cpu() - torch.tensor(lps)).abs().max().item())  # host sync: a check
            diffs.append(worst)
    if tol is None:
        tol = verify_tolerance(*compute, *([engine_dtype] if engine_dtype is not None else []))
    per_engine_versions = tuple(versions[i * len(probe_prompts)] for i in range(len(answers)))
    return VerifyResult(tuple(diffs), per_engine_versions, expected_version, tol)
