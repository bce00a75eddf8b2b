"""SFT examples from prompt/answer records, in the layout each [data].format trains on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def sft_examples(prompts: Sequence[Any], tokenizer: Any, fmt: str) -> list[Any]:
    """SFT examples from prompt/answer records.

    chat: one-turn conversations (a record may carry full "messages" in its metadata instead), tokenized by
    trainer.sft with the assistant-only mask. plain: Samples `prompt + answer + eos`, the loss on answer + eos,
    exactly the token layout the rollouts of a plain-format run produce.
    """
    from trainer.rollout.samples import prompt_token_ids
    from trainer.types import Sample

    for i, p in enumerate(prompts):
        if p.answer is None and not p.metadata.get("messages"):
            raise ValueError(f"SFT example {i} ({p.prompt[:40]!r}) has no answer, and SFT trains on the answer (it "
                             f"would train on the text \"None\"); give it one or SFT on conversations")
    if fmt == "plain":
        out = []
        for p in prompts:
            prompt_ids = prompt_token_ids(tokenizer, p.prompt, chat=False)
            answer_ids = prompt_token_ids(tokenizer, str(p.answer), chat=False) + [tokenizer.eos_token_id]
            out.append(Sample(prompt=p.prompt, tokens=tuple(prompt_ids + answer_ids), response_length=len(answer_ids)))
        return out
    out = []
    for p in prompts:
        msgs = p.metadata.get("messages")
        out.append(list(msgs) if msgs else [{"role": "user", "content": p.prompt},
                                            {"role": "assistant", "content": str(p.answer)}])
    return out
