"""Batched sampling with a KV cache: many prompts, one forward per step.

Prompts are left-padded into one [B, L] batch (position ids count only real tokens, so padding changes nothing
but the attention mask), prefilled once, then decoded one token per step with the HF cache. Each row carries its
own sampling settings and its own `torch.Generator`, so a row's tokens depend on its seed, not on which other
requests share the batch. Returned log-probs are log_softmax of the raw logits (temperature 1, no top-k/top-p),
i.e. the policy's own log-prob of each sampled token, which is what the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class Row:
    """One sequence to generate. stop_ids ends the row (the stop token is kept in the output)."""

    prompt: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int


@dataclass(frozen=True)
class RowResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


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


def sample_next(logits: torch.Tensor, rows: list[Row], generators: list[torch.Generator],
                knobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next token per row [B] (int64) from fp32 logits [B, V]."""
    temperature, top_k, top_p = knobs
    greedy = logits.argmax(-1)
    if bool((temperature == 0).all()):
        return greedy
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    out = greedy.clone()
    for i, row in enumerate(rows):  # per-row generator: a row's draw depends only on its own seed
        if row.temperature > 0:
            out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out


def _row_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@torch.inference_mode()
def generate_rows(model, rows: list[Row], *, pad_id: int, decode_fn=None) -> list[RowResult]:
    """Generate every row in one batch. decode_fn (default model.forward) runs the one-token decode step;
    the engine passes a torch.compile'd forward on CUDA."""
    if not rows:
        return []
    for r in rows:
        if len(r.prompt) == 0:
            raise ValueError("a prompt is empty: give at least one input token (e.g. the bos id)")
    device = next(model.parameters()).device
    decode_fn = decode_fn or model.forward
    B, L = len(rows), max(len(r.prompt) for r in rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, L), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        input_ids[i, L - len(r.prompt):] = torch.tensor(r.prompt, device=device)
        mask[i, L - len(r.prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    knobs = (torch.tensor([r.temperature for r in rows], device=device, dtype=torch.float32),
             torch.tensor([r.top_k for r in rows], device=device),
             torch.tensor([r.top_p for r in rows], device=device, dtype=torch.float32))
    gens = [_row_generator(r.seed, device) for r in rows]
    max_new = torch.tensor([r.max_new_tokens for r in rows], device=device)
    steps = int(max_new.max())
    out_ids = [[] for _ in rows]
    out_lp = [[] for _ in rows]
    reason = ["length"] * B
    done = max_new == 0
    if steps == 0:
        return [RowResult([], [], "length") for _ in rows]

    cache = DynamicCache()
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1].float()  # [B, V]
    next_pos = positions[:, -1:] + 1
    for step in range(steps):
        logprobs = logits.log_softmax(-1)
        tok = sample_next(logits, rows, gens, knobs)
        tok_lp = logprobs.gather(-1, tok[:, None])[:, 0]
        # One host sync per step: the finished-row bookkeeping needs the tokens on the host.
        tok_host, lp_host, done_host = tok.tolist(), tok_lp.tolist(), done.tolist()
        for i, r in enumerate(rows):
            if done_host[i]:
                continue
            out_ids[i].append(tok_host[i])
            out_lp[i].append(lp_host[i])
            if tok_host[i] in r.stop_ids:
                reason[i] = "stop"
                done[i] = True
            elif len(out_ids[i]) >= r.max_new_tokens:
                done[i] = True
        if bool(done.all()) or step == steps - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        logits = decode_fn(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                           past_key_values=cache, use_cache=True).logits[:, -1].float()
        next_pos = next_pos + 1
    return [RowResult(out_ids[i], out_lp[i], reason[i]) for i in range(B)]
