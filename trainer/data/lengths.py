"""Lengths of a run's data against the model's context and the token budgets, checked when the data loads
(trainer.cli, with the config), so that an over-long input is refused or named before any work instead of a crash
mid-run, an SFT run that trains on nothing, or a prompt past the model's positions.

Errors (the run would crash, or a row can never be trained as given):
  - a prompt (RL or evaluation) that fills the model's context (max_position_embeddings): no room to generate;
  - an RL prompt + [rl.rollout] max_new_tokens beyond [rl] token_budget: a sample that long cannot be packed;
  - an SFT example longer than [sft] token_budget or the model's context after the [sft] max_length cut;
  - a plain-format SFT example (prompt + answer + eos) longer than [sft] max_length (it is not cut: trainer.sft
    refuses it);
  - every SFT example losing trained tokens to [sft] max_length: the run would train on no answer whole (on
    nothing at all, loss 0, when the cut falls before every answer).
Warnings (only samples that run long are affected):
  - a prompt + max_new_tokens beyond the model's context: a response that runs to max_new_tokens passes it;
  - some (not all) SFT examples cut by max_length (trainer.sft counts them when it tokenizes).
Each message names the first offending row (the file and the row) and the key to change. Rows are (where, length)
pairs: `where` is "<file>: row <n>".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from trainer.data.buffer import PromptSet
from trainer.rollout.samples import prompt_token_ids
from trainer.types import Sample


def prompt_lengths(sets: Iterable[PromptSet], tokenizer: Any, *, chat: bool) -> list[tuple[str, int]]:
    """(where, tokens) of every prompt as the engines receive it (the chat template and system turn included)."""
    return [(f"{s.spec.path}: row {i}", len(prompt_token_ids(tokenizer, p.prompt, chat=chat, system=p.system)))
            for s in sets for i, p in enumerate(s)]


def sft_lengths(examples: Iterable[tuple[str, Any]], tokenizer: Any, *, max_length: int) -> list[tuple[str, int, bool]]:
    """(where, tokens, cut) of (where, SFT example) pairs as trainer.sft tokenizes them (a conversation, or a
    plain-format Sample: trainer.run.sft_examples): the whole length, and whether the [sft] max_length cut loses
    trained tokens (a plain Sample is never cut: longer than max_length, it is refused)."""
    from trainer.sft import compute_loss_mask

    out = []
    for where, example in examples:
        if isinstance(example, Sample):
            out.append((where, len(example.tokens), len(example.tokens) > max_length))
        else:
            ids, mask = compute_loss_mask(tokenizer, example)
            out.append((where, len(ids), any(mask[max_length:])))
    return out


def check_prompt_lengths(rows: Sequence[tuple[str, int]], *, data_key: str, context: int | None,
                         max_new_tokens: int, new_tokens_key: str, token_budget: int | None = None) -> None:
    """Prompts against the context (an error when one fills it, a warning when a full-length response would pass
    it) and, for the prompts a phase trains on, prompt + max_new_tokens against its `token_budget` (an error)."""
    for where, n in rows:
        if context is not None and n >= context:
            raise ValueError(f"[data].{data_key}: {where}: the prompt is {n} tokens and the model's context "
                             f"(max_position_embeddings) is {context}: no room to generate; shorten or drop the row, "
                             f"or use a model with a longer context")
        if token_budget is not None and n + max_new_tokens > token_budget:
            raise ValueError(f"[data].{data_key}: {where}: the prompt is {n} tokens, + {new_tokens_key} = "
                             f"{max_new_tokens} is {n + max_new_tokens} > [rl] token_budget = {token_budget}: a "
                             f"sample that long cannot be trained; raise [rl] token_budget (a multiple of "
                             f"micro_batch_buckets) or lower {new_tokens_key}")
    if context is not None:
        over = [(where, n) for where, n in rows if n + max_new_tokens > context]
        if over:
            where, n = over[0]
            warnings.warn(f"[data].{data_key}: {len(over)} prompts leave less than {new_tokens_key} = {max_new_tokens} "
                          f"tokens of the model's context ({context}); the first, {where}, is {n} tokens: a response "
                          f"that runs that long passes the context; lower {new_tokens_key} to {context - n} or "
                          f"shorten the prompts", stacklevel=2)


def check_sft_lengths(rows: Sequence[tuple[str, int, bool]], *, max_length: int, token_budget: int,
                      context: int | None, plain: bool) -> None:
    """SFT examples against [sft] max_length, token_budget and the model's context (errors: see the module)."""
    if not rows:
        return
    if plain:
        long = [(where, n) for where, n, _ in rows if n > max_length]
        if long:
            where, n = long[0]
            raise ValueError(f"[data].sft: {where}: the example (prompt + answer + eos) is {n} tokens > [sft] "
                             f"max_length = {max_length} ({len(long)} of {len(rows)} are); raise [sft] max_length to "
                             f"{max(m for _, m in long)} or shorten the examples")
    cut = [(where, n) for where, n, lost in rows if lost]
    if len(cut) == len(rows):
        longest = max(n for _, n in cut)
        raise ValueError(f"[data].sft: every one of the {len(rows)} SFT examples loses trained (assistant) tokens to "
                         f"[sft] max_length = {max_length} (the first, {cut[0][0]}, is {cut[0][1]} tokens): the run "
                         f"would train on no answer whole; raise [sft] max_length to {longest} (the longest)")
    for where, n, _ in rows:
        kept = min(n, max_length)
        if kept > token_budget:
            raise ValueError(f"[data].sft: {where}: the example is {kept} tokens (after the [sft] max_length cut) > "
                             f"[sft] token_budget = {token_budget}; raise token_budget (a multiple of "
                             f"micro_batch_buckets) or lower max_length")
        if context is not None and kept > context:
            raise ValueError(f"[data].sft: {where}: the example is {kept} tokens (after the [sft] max_length cut) > "
                             f"the model's context (max_position_embeddings) = {context}; lower [sft] max_length to "
                             f"{context}")
