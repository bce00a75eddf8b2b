"""The embedded engine's decode loop (engines/embedded/generation.py; issue 26 item 7).

Batched sampling (one exponential race per row from the row's generator, one divide and argmax for the batch) draws
the token `torch.multinomial(probs[i], 1, generator=g_i)` draws, with the same log-prob, and leaves every generator
in the state multinomial leaves it in (greedy rows: untouched), over many fresh seeds and several consecutive steps.
"""

from __future__ import annotations

import collections

import torch

from engines.embedded.generation import Row, SamplingTensors, filter_logits, sample_with_logprobs


# ------------------------------------------------------------------------------------------------ references
def _reference_sample(logits: torch.Tensor, row: Row, gen: torch.Generator) -> tuple[int, float]:
    """One row, written plainly: log-probs at the row's temperature (1 when greedy), the token by argmax (greedy)
    or by torch.multinomial on the top-k/top-p-filtered (or plain) probabilities. logits [V] fp32."""
    device = logits.device
    temperature = torch.tensor([row.temperature], dtype=torch.float32, device=device)
    logprobs = (logits[None] / (temperature if row.temperature > 0 else 1.0)).log_softmax(-1)[0]
    if row.temperature == 0:
        tok = int(logits.argmax())
    else:
        if row.top_k > 0 or row.top_p < 1:
            probs = filter_logits(logits[None], temperature, torch.tensor([row.top_k], device=device),
                                  torch.tensor([row.top_p], dtype=torch.float32, device=device)).softmax(-1)[0]
        else:
            probs = logprobs.exp()
        tok = int(torch.multinomial(probs, 1, generator=gen)[0])
    return tok, float(logprobs[tok])


def _random_row(g: torch.Generator, vocab: int, **fields) -> Row:
    """A row with random sampling parameters: greedy or T in [0.2, 2); top-k off, 0 or 1..V+4; top-p off or
    in [0.05, 0.99)."""
    u = torch.rand(5, generator=g).tolist()
    temperature = 0.0 if u[0] < 0.25 else 0.2 + 1.8 * u[1]
    top_k = [-1, 0, int(torch.randint(1, vocab + 5, (), generator=g))][int(u[2] * 3)]
    top_p = 1.0 if u[3] < 0.4 else 0.05 + 0.94 * u[4]
    defaults = dict(prompt=(1,), temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1,
                    stop_ids=frozenset(), seed=int(torch.randint(0, 2**62, (), generator=g)))
    return Row(**{**defaults, **fields})


def _params(rows: list[Row]) -> SamplingTensors:
    return SamplingTensors.of(rows)


# ------------------------------------------------------------------------------------------------ sampling
def test_batched_sampling_draws_what_per_row_multinomial_draws():
    g = torch.Generator().manual_seed(2026)
    seen = collections.Counter()
    for _ in range(60):
        B = int(torch.randint(1, 10, (), generator=g))
        V = [2, 7, 1271, 5003][int(torch.randint(0, 4, (), generator=g))]
        rows = [_random_row(g, V) for _ in range(B)]
        ours = [torch.Generator().manual_seed(r.seed) for r in rows]
        theirs = [torch.Generator().manual_seed(r.seed) for r in rows]
        start = [gen.get_state() for gen in ours]
        for _step in range(4):  # consecutive draws: the generators must advance alike
            scale = 0.5 + 7.5 * float(torch.rand((), generator=g))
            logits = torch.randn(B, V, generator=g) * scale
            tok, lp = sample_with_logprobs(logits, _params(rows), rows, ours)
            for i, row in enumerate(rows):
                ref_tok, ref_lp = _reference_sample(logits[i], row, theirs[i])
                assert int(tok[i]) == ref_tok, (i, row)
                assert float(lp[i]) == ref_lp, (i, row)
                assert torch.equal(ours[i].get_state(), theirs[i].get_state())
                if row.temperature == 0:
                    assert torch.equal(ours[i].get_state(), start[i])  # greedy rows leave the generator alone
                kind = "greedy" if row.temperature == 0 else (
                    "filtered" if row.top_k > 0 or row.top_p < 1 else "plain")
                seen[kind] += 1
                seen["not argmax"] += ref_tok != int(logits[i].argmax())
    assert min(seen.values()) > 50, seen  # every kind of row, and draws that are not the argmax
