"""The embedded engine's sampling: one call draws a token for every row of a decode step
(engines/embedded/generation.py; the module docstring there says how draws are keyed).

Each row draws from softmax(logits / T) at its temperature T, top-k/top-p-filtered where it asks, by inverse CDF
with a uniform from Philox keyed by (the row's seed, the position of the token) (kernels.sampling), and reports
the log-prob of its token before the filters: log_softmax(logits / T)[token] (temperature 0: the argmax, and
log_softmax(logits)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.sampling import sample_tokens, seed_words

# The rows sampled: engines.embedded.generation.Row, of which this reads temperature, top_k, top_p and seed (not
# imported: generation imports this module).
Row = Any


@dataclass(frozen=True)
class SamplingTensors:
    """Each row's sampling parameters as device tensors [B] (batch order): built when rows join, selected when rows
    leave, so a step reads them without a host-to-device copy."""

    temperature: torch.Tensor  # fp32; 0: greedy
    top_k: torch.Tensor  # int64; <= 0: off
    top_p: torch.Tensor  # fp32; 1: off
    key: torch.Tensor  # [B, 2] int64: the seed's Philox key words (kernels.sampling.seed_words), each < 2^32

    @staticmethod
    def of(rows: Sequence[Row]) -> SamplingTensors:
        """The rows' parameters as CPU tensors (the caller moves them with the step's other inputs; every value is
        exact in the float64 of that one copy)."""
        return SamplingTensors(torch.tensor([r.temperature for r in rows], dtype=torch.float32),
                               torch.tensor([r.top_k for r in rows], dtype=torch.long),
                               torch.tensor([r.top_p for r in rows], dtype=torch.float32),
                               torch.tensor([seed_words(r.seed) for r in rows], dtype=torch.long).view(-1, 2))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.key

    def select(self, idx: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(*(t.index_select(0, idx) for t in self.tensors()))

    def cat(self, other: SamplingTensors) -> SamplingTensors:
        return SamplingTensors(*(torch.cat([a, b]) for a, b in zip(self.tensors(), other.tensors())))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scale and top-k/top-p-mask logits [B, V] (rows with temperature 0 are left for argmax).

    top_k [B] (<= 0: off), top_p [B] (1: off). The most likely token always survives both filters."""
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    drop = ranks >= k[:, None]
    # top-p: drop a token when the mass of strictly more likely tokens already reaches top_p.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, masked_sorted)


def sample_with_logprobs(logits: torch.Tensor, params: SamplingTensors, rows: Sequence[Row],
                         position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token [B] int64, its log-prob [B] fp32 at the row's temperature) from fp32 logits [B, V].

    params: the rows' parameters on the device; rows: the same on the host (whether any row samples, how many
    filter); position [B] int64: the position each row's token takes, which with the row's seed keys its draw."""
    temperature = params.temperature
    # temperature 0 (greedy) reports temperature-1 log-probs
    logprobs = (logits / torch.where(temperature > 0, temperature, 1.0)[:, None]).log_softmax(-1)
    tok = logits.argmax(-1)
    if any(r.temperature > 0 for r in rows):
        probs = logprobs.exp()  # [B, V]: rows without top-k/top-p sample the scaled distribution itself
        m = sum(1 for r in rows if r.temperature > 0 and (r.top_k > 0 or r.top_p < 1))
        if m:
            # Only the m rows that ask go through the filters' sort: their indices, ascending, from a stable sort
            # of the device flags (the host knows m, so nothing is read back).
            asks = (temperature > 0) & ((params.top_k > 0) | (params.top_p < 1))  # [B]
            idx = torch.argsort((~asks).to(torch.int32), stable=True)[:m]  # [m]
            kept = filter_logits(logits.index_select(0, idx), temperature.index_select(0, idx),
                                 params.top_k.index_select(0, idx), params.top_p.index_select(0, idx))
            probs = probs.index_copy(0, idx, kept.softmax(-1))
        tok = torch.where(temperature > 0, sample_tokens(probs, params.key, position), tok)
    return tok, logprobs.gather(-1, tok[:, None])[:, 0]
