"""Adapter-only weight sync of a LoRA model (issue 38 item 3): after the first sync (the base, unmerged, plus the
adapters) every sync sends the adapters' A and B alone (sync bytes = adapter bytes), by the disk-free paths (the
in-process engine's shared slots, the HTTP engine's gloo broadcast), and the engine applies them as its default
adapter without touching its base weights: its answers equal those of an engine synced with the merged weights."""

from __future__ import annotations

import pytest
import torch
import trio
from engine_support import perturb_lora

from engines.embedded.presets import build_tiny_model
from engines.local import LocalEngine
from engines.protocol import SamplingParams
from engines.sglang import SGLangEngine
from trainer.backend.lora import ADAPTER, inject, lora_layers
from trainer.config import LoRAConfig
from trainer.weight_sync import WeightSyncSender, verify_sync

ENGINE_SEED = 6  # the `engine` fixture's tiny model (tests/conftest.py)
PROBES = [[1, 20, 21, 22], [1, 7, 8, 9, 10], [1, 40]]


def lora_trainer(seed: int, *, train_unembed: bool = False):
    model = build_tiny_model(seed)
    inject(model, LoRAConfig(rank=3, alpha=6.0, target_modules="all-linear", train_unembed=train_unembed))
    perturb(model, 0)
    return model


def perturb(model, seed: int) -> None:
    perturb_lora(model, seed, adapter_scale=0.1, base_scale=0.01)


def adapter_bytes(model) -> int:
    return sum(layer.lora_A[ADAPTER].weight.nbytes + layer.lora_B[ADAPTER].weight.nbytes
               for layer in lora_layers(model).values())


def answers(engine, params: SamplingParams):
    return trio.run(lambda: engine.generate(PROBES, params))


def same_answers(a, b) -> None:
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            assert ca.output_ids == cb.output_ids
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) <= 1e-5


@pytest.mark.parametrize("train_unembed", [False, True])
def test_in_process_engine_takes_adapters_alone(train_unembed):
    seed = 4
    trainer = lora_trainer(seed, train_unembed=train_unembed)
    base = {n: p.detach().clone() for n, p in build_tiny_model(seed).named_parameters()}
    ours, merged = LocalEngine("tiny", seed=seed), LocalEngine("tiny", seed=seed)
    try:
        sender = WeightSyncSender(trainer, [ours], timeout_s=60, lora="adapters")
        reference = WeightSyncSender(trainer, [merged], timeout_s=60, lora="merged")
        sender.init_group()
        reference.init_group()
        full = sum(p.nbytes for p in base.values())
        lm_head = trainer.get_output_embeddings().weight.nbytes if train_unembed else 0
        params = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=9)
        for step in range(1, 4):
            if step > 1:
                perturb(trainer, step)
            assert sender.sync() == reference.sync() == step
            # The first sync brings the base (unmerged) with the adapters; then the adapters (and a trained lm_head).
            want = full + adapter_bytes(trainer) if step == 1 else adapter_bytes(trainer) + lm_head
            assert sender.last_sync_bytes == want and reference.last_sync_bytes == full
            assert ours.server.adapters.default == "policy" and ours.server.adapter_names() == ["policy"]
            for n, p in ours.server.model.named_parameters():  # the base stays the base (a trained lm_head moves)
                if not (train_unembed and n == "lm_head.weight"):
                    assert torch.equal(p, base[n]), n
            same_answers(answers(ours, params), answers(merged, params))
            res = verify_sync(trainer, [ours], PROBES, expected_version=step)
            assert res.ok and res.max_abs_diff[0] <= 1e-5, res
        assert adapter_bytes(trainer) < full / 5  # the point: far fewer bytes than the merged sync
        sender.close()
        # Whole models again (a full RL phase after a LoRA SFT): the engine's default adapter goes, so requests
        # that name none get the weights sent, not the stale adapter on top of them.
        perturb(trainer, 9)
        whole = WeightSyncSender(trainer, [ours], timeout_s=60, lora="merged", weight_version=3)
        whole.init_group()
        assert whole.sync() == reference.sync() == 4 and ours.server.adapters.default is None
        same_answers(answers(ours, params), answers(merged, params))
        whole.close()
        reference.close()
    finally:
        ours.close()
        merged.close()


def test_http_engine_takes_adapters_by_broadcast(engine):
    """The embedded engine process over HTTP, the gloo broadcast group: the same adapter-only syncs."""
    trainer = lora_trainer(ENGINE_SEED)
    http = SGLangEngine(engine.url, timeout_s=60)
    sender = WeightSyncSender(trainer, [http], timeout_s=60, transport="broadcast")  # lora="auto" picks adapters
    sender.init_group()
    try:
        for step in (1, 2):
            perturb(trainer, 10 + step)
            assert sender.sync() == step and sender.adapter_sync
            if step == 2:
                assert sender.last_sync_bytes == adapter_bytes(trainer)
            res = verify_sync(trainer, [http], PROBES, expected_version=step)
            assert res.ok and res.max_abs_diff[0] <= 1e-5, res
        info = trio.run(http.get_server_info)
        assert info["lora_adapters"] == ["policy"]
    finally:
        sender.close()
