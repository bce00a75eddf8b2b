"""Helpers shared by the rollout tests (imported as a plain module: pytest puts tests/ on sys.path)."""

from __future__ import annotations

from engines.tiny import build_tokenizer


class Counted:
    """An engine client that counts its generate calls still running: none may be once a batch has returned (no
    request left behind in the background)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.running = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompts, params, *, rids=None):
        self.running += 1
        try:
            return await self._engine.generate(prompts, params, rids=rids)
        finally:
            self.running -= 1



# The project tokenizer's digit ids (the tiny preset's vocabulary: the same ids in every test).
DIGITS = frozenset(build_tokenizer().convert_tokens_to_ids(list("0123456789")))


def digit_fraction(sample) -> float:
    """A dense verifiable reward a random tiny model learns fast: the fraction of its response tokens that are
    digits (the tests' RL runs assert that it rises)."""
    resp = sample.tokens[sample.prompt_length:]
    return sum(t in DIGITS for t in resp) / max(len(resp), 1)
