"""Helpers shared by the rollout tests (imported as a plain module: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from engines.tiny import build_tokenizer


def repeating_model(seed: int = 7, scale: float = 4.0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny qwen2 model with lm_head = scale x the token embedding: its next token is often its last one again,
    so the samples of a prompt often draw alike for a while and n-gram drafts are often right (a random model's
    samples part at once and its drafts are almost never drawn)."""
    from engines.embedded.presets import build_tiny_model

    model = build_tiny_model(seed, arch="qwen2", dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(scale * model.model.embed_tokens.weight)
    return model


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


def random_peft_adapter(base, folder, *, r: int, alpha: float, targets, seed: int, scale: float = 0.3):
    """A PEFT adapter on `base` (modified in place: pass a copy to keep it) with random A and B (seeded, N(0,
    scale^2); B = 0 would be the base itself), saved to `folder`; returns the PeftModel (merge_and_unload a deep copy
    of it for the reference)."""
    import peft
    import torch

    pm = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    pm.save_pretrained(str(folder))
    return pm


def perturb_lora(model, seed: int, *, adapter_scale: float, base_scale: float) -> None:
    """New adapter values (B starts at zero: the adapter would be a no-op) and a nudge to the other trainable
    weights (lm_head with train_unembed), as a train step would make; seeded."""
    import torch

    from trainer.backend.lora import is_adapter

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter(n):
                p.copy_(torch.randn(p.shape, generator=g) * adapter_scale)
            elif p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * base_scale)

