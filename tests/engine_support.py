"""Helpers shared by the rollout tests (imported as a plain module: pytest puts tests/ on sys.path)."""

from __future__ import annotations


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
