"""The TrainingBackend surface in process (trainer/backend/protocol.py): LoRA log-probs and gradients against a
float64 reference of the same PEFT model, futures in submission order, awaited from trio."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.backend.protocol import AdamParams, Datum, LocalLoraBackend, LoraBase, LoraSpec
from trainer.serve.losses import LOSSES


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from engines.embedded.presets import build_tiny_model

    folder = tmp_path_factory.mktemp("backend") / "tiny"
    build_tiny_model(0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1).save_pretrained(folder)
    return LoraBase(folder)


def batch(seed: int, vocab: int, lengths=(6, 9, 4)) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        toks = torch.randint(0, vocab, (n + 1,), generator=g)
        out.append(Datum(toks[:-1], {"target_tokens": toks[1:], "weights": torch.rand(n, generator=g) + 0.5}))
    return out


def randomize(backend: LocalLoraBackend, seed: int) -> None:
    """Adapters away from PEFT's init (B = 0 would hide every B-path error)."""
    g = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(p.shape, generator=g) * 0.3 for k, p in backend.params.items()}
    backend.load_weights(weights).result()


def reference(base: LoraBase, name: str, data: list[Datum]):
    """float64 log-probs [T] per datum and adapter gradients of -sum(weights * logp), through the plain PEFT
    model's own forward (full logits, log_softmax) on a float64 copy."""
    model = copy.deepcopy(base.model).double()
    params = {n: p for n, p in model.named_parameters() if f".{name}." in n}
    for p in params.values():
        p.requires_grad_(True)
    from peft.tuners.lora import LoraLayer

    for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
        layer._active_adapter = [name] if name in layer.lora_A else []
    total, logps = 0.0, []
    for d in data:
        logits = model(input_ids=d.tokens[None]).logits[0]
        lp = torch.log_softmax(logits, -1).gather(1, d.loss_inputs["target_tokens"][:, None])[:, 0]
        logps.append(lp)
        total = total - (lp * d.loss_inputs["weights"].double()).sum()
    total.backward()
    return [lp.detach() for lp in logps], {n.replace(f".{name}.", "."): p.grad for n, p in params.items()}


@pytest.mark.parametrize("unembed", [True, False])
def test_logprobs_and_gradients_match_float64_reference(base, unembed):
    name = f"ref{int(unembed)}"
    backend = LocalLoraBackend(base, name, LoraSpec(rank=4, seed=1, train_unembed=unembed), LOSSES, "/nonexistent")
    randomize(backend, 2)
    data = batch(3, base.vocab_size)
    ref_lp, ref_grad = reference(base, name, data)
    out = backend.forward_backward(data, "cross_entropy").result()
    for got, want in zip(out.outputs, ref_lp):
        assert (got["logprobs"].double() - want).abs().max() <= 1e-5
    grads = {k: p.grad for k, p in backend.params.items()}
    assert set(grads) == set(ref_grad) and (any("lm_head" in k for k in grads) == unembed)
    for k, g in grads.items():
        rel = (g.double() - ref_grad[k]).norm() / ref_grad[k].norm().clamp(min=1e-30)
        assert rel <= 1e-4, (k, float(rel))
    backend.close().result()


def test_closing_one_client_leaves_the_others_adapters_training(base):
    """Was: PEFT's delete_adapter, removing the adapter that ran last, froze every other adapter of those layers
    (requires_grad False): a client trained on attention only and closed left another client's attention LoRA
    frozen, its MLP and lm_head training (no error, other losses), or failed its backward outright."""
    attn = LocalLoraBackend(base, "attn_only", LoraSpec(rank=4, seed=3, train_mlp=False, train_unembed=False), LOSSES,
                            "/nonexistent")
    # PEFT re-activates the first remaining adapter by name in each layer it removed the active one from, and
    # freezes the others: "b_other" is that one, "full" (the client checked) one of the others
    other = LocalLoraBackend(base, "b_other", LoraSpec(rank=4, seed=5), LOSSES, "/nonexistent")
    full = LocalLoraBackend(base, "full", LoraSpec(rank=4, seed=4), LOSSES, "/nonexistent")
    randomize(full, 8)
    data = batch(9, base.vocab_size)
    attn.forward_backward(data, "cross_entropy").result()  # its adapter is the active one in the attention layers
    attn.close().result()
    ref_lp, ref_grad = reference(base, "full", data)
    full.forward_backward(data, "cross_entropy").result()
    assert set(ref_grad) == set(full.params) and any("q_proj" in k for k in full.params)
    for k, p in full.params.items():
        assert p.requires_grad and p.grad is not None, k
        rel = (p.grad.double() - ref_grad[k]).norm() / ref_grad[k].norm().clamp(min=1e-30)
        assert rel <= 1e-4, (k, float(rel))
    full.close().result()
    other.close().result()


def test_queued_in_submission_order_and_awaited_from_trio(base):
    """forward_backward, optim_step and forward queued before any is read run in that order (the forward sees
    the update); each future can be awaited from trio; bad input is refused at submission."""
    import trio

    backend = LocalLoraBackend(base, "order", LoraSpec(rank=4, seed=5), LOSSES, "/nonexistent")
    data = batch(6, base.vocab_size)
    before = backend.forward(data).result()

    async def main():
        fb = backend.forward_backward(data, "cross_entropy")
        opt = backend.optim_step(AdamParams(learning_rate=0.05))
        fwd = backend.forward(data)
        return await fb, await opt, await fwd

    fb, opt, fwd = trio.run(main)
    assert fb.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-6)
    assert opt["grad_norm:mean"] > 0
    assert fwd.metrics["loss:sum"] < before.metrics["loss:sum"]  # the step ran before the queued forward
    with pytest.raises(ValueError, match="unknown loss_fn 'nope'"):
        backend.forward_backward(data, "nope")
    bad = [Datum(torch.tensor([1, base.vocab_size]), {"target_tokens": torch.tensor([1, 2])})]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.forward_backward(bad, "cross_entropy")
    weights = backend.get_weights().result()
    assert set(weights) == set(backend.params) and all(not w.requires_grad for w in weights.values())
    backend.close().result()
