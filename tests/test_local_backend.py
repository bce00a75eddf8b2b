"""trainer.backend.local: the TrainingBackend surface over TrainingComponents, the way the SFT and RL loops train.

A step through LocalBackend (samples -> Tinker-shaped datums -> forward_backward -> optim_step) must be the step the
loops ran before it existed, bit for bit: the same micro-batches (plain or shared-prompt), the same kernels, the
same metrics and weights.
"""

from __future__ import annotations

import pytest
import torch

from engines.tiny import tiny_model_config
from kernels import use_backend
from trainer.backend.local import LocalBackend, from_datums, to_datums
from trainer.backend.protocol import AdamParams
from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from
from trainer.batching.micro_batches import build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig, SFTTrainingConfig
from trainer.types import Sample, Status, TrainingState


@pytest.fixture(autouse=True)
def torch_path():
    with use_backend("torch"):
        yield


def _samples(seed: int) -> list[Sample]:
    """Three groups of four (a shared prompt each), random responses, masks on some, engine log-probs on all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(3):
        prompt = torch.randint(6, 90, (3 + group,), generator=g).tolist()
        for i in range(4):
            n = 2 + (3 * i + group) % 5
            mask = tuple(int(x) for x in (torch.rand(n, generator=g) > 0.3)) if i % 2 else None
            response = torch.randint(6, 90, (n,), generator=g).tolist()
            out.append(Sample(prompt="", tokens=(*prompt, *response), response_length=n, loss_mask=mask,
                              rollout_logprobs=(-torch.rand(n, generator=g)).tolist(),
                              reward=float(torch.rand((), generator=g)), group_index=group, index=i,
                              status=Status.COMPLETED))
    return out


def test_datums_carry_what_the_micro_batches_pack():
    samples = _samples(0)
    advantages = torch.randn(len(samples), dtype=torch.float64).tolist()
    datums, extra = to_datums(samples, advantages)
    d, s = datums[1], samples[1]
    p = s.prompt_length
    assert torch.equal(d.tokens, torch.tensor(s.tokens[:-1])) and d.loss_inputs["target_tokens"].tolist() == \
        list(s.tokens[1:])
    assert d.loss_inputs["weights"][: p - 1].eq(0).all() and d.loss_inputs["weights"][p - 1:].tolist() == \
        list(s.effective_loss_mask)
    assert d.loss_inputs["advantages"][p - 1:].eq(torch.tensor(advantages[1], dtype=torch.float32)).all()
    back, adv = from_datums(datums, extra["prompt_lengths"])
    for a, b in zip(samples, back):
        assert a.tokens == b.tokens and a.prompt_length == b.prompt_length
        assert a.effective_loss_mask == b.effective_loss_mask
        assert torch.equal(torch.tensor(a.rollout_logprobs, dtype=torch.float32),
                           torch.tensor(b.rollout_logprobs, dtype=torch.float32))
    assert adv == torch.tensor(advantages, dtype=torch.float32).tolist()


@pytest.mark.parametrize("share,lora", [(True, None), (False, {"rank": 4})], ids=["full_shared", "lora_plain"])
def test_a_step_through_the_backend_is_the_direct_step_bit_for_bit(share, lora):
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2), token_budget=32, micro_batch_buckets=8, lora=lora,
                           loss={"loss_agg": "seq-mean-token-mean", "rollout_correction": "tis"},
                           rollout=RolloutConfig(apply_chat_template=False, max_new_tokens=8))
    tcfg = trainer_config_from(cfg, compile=False, share_prompts=share)
    samples = _samples(1)
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(2)).tolist()

    def weights(comp):
        ps = [p.detach() for p in comp.model.parameters()]
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).flatten() for p in ps])

    comp = build_components(tiny_model_config("llama"), tcfg)
    build = build_shared_micro_batches if share else build_micro_batches
    mbs = build(samples, token_budget=32, bucket_size=8, advantages=advantages, pad_id=0)
    assert len(mbs) > 1 and all((mb.trees is not None) == share for mb in mbs)
    want = []
    for _ in range(2):
        fut = forward_backward(comp, mbs, tcfg)
        opt, _ = optim_step(comp, TrainingState(), tcfg, num_tokens=fut.num_tokens)
        want.append({**fut.result(), **opt.result()})
    direct = weights(comp)

    comp = build_components(tiny_model_config("llama"), tcfg)
    backend = LocalBackend(comp, tcfg, pad_id=0)
    datums, extra = to_datums(samples, advantages)
    got = []
    for _ in range(2):
        fb, opt = backend.forward_backward(datums, "policy", extra), backend.optim_step()
        got.append({**fb.result().metrics, **opt.result()})
    assert got == want and torch.equal(weights(comp), direct)
    served = backend.get_weights().result()  # what an engine serves: adapters merged, stock names
    if lora is None:
        assert served.keys() == dict(comp.model.named_parameters()).keys()
        assert torch.equal(torch.cat([w.flatten() for w in served.values()]), direct)
    else:
        assert not any("lora" in k for k in served) and "model.embed_tokens.weight" in served

    # forward: the log-prob of every trained target, as a plain forward of each sequence alone gives it
    out = backend.forward(datums, "cross_entropy", {"prompt_lengths": extra["prompt_lengths"]}).result().outputs
    with torch.no_grad():
        for s, o in zip(samples, out):
            ids = torch.tensor([s.tokens])
            logits = comp.root(lambda lm, ids=ids: lm(input_ids=ids).logits)[0, :-1].float()
            want = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            trained = torch.tensor([0] * (s.prompt_length - 1) + list(s.effective_loss_mask), dtype=torch.bool)
            assert torch.allclose(o["logprobs"][trained], want[trained], atol=1e-5, rtol=0)
            assert o["logprobs"][~trained].eq(0).all()


def test_bad_calls_are_refused_naming_the_fix():
    cfg = RLTrainingConfig(token_budget=32, micro_batch_buckets=8,
                           rollout=RolloutConfig(apply_chat_template=False, max_new_tokens=8))
    tcfg = trainer_config_from(cfg, compile=False)
    backend = LocalBackend(build_components(tiny_model_config("llama"), tcfg), tcfg, pad_id=0)
    datums, extra = to_datums(_samples(3), [0.0] * 12)
    with pytest.raises(ValueError, match="loss_fn 'nll'.*'policy'"):
        backend.forward_backward(datums, "nll", extra)
    with pytest.raises(ValueError, match="lacks 'prompt_lengths'"):
        backend.forward_backward(datums, "policy", {})
    with pytest.raises(ValueError, match=r"keys \['beta'\]"):
        backend.forward_backward(datums, "policy", {**extra, "beta": 0.1})
    with pytest.raises(ValueError, match="3 entries for 12 datums"):
        backend.forward_backward(datums, "policy", {"prompt_lengths": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"\[rl.optim\]"):
        backend.optim_step(AdamParams())


def test_an_sft_step_through_the_backend_is_the_direct_step_bit_for_bit():
    """SFT's NLL packs plain (never the shared-prompt layout, whatever [trainer] share_prompts says), and a sample
    with an empty prompt trains the tokens it trained before (no position predicts its first token)."""
    cfg = SFTTrainingConfig(optim=OptimConfig(lr=1e-2), token_budget=32, micro_batch_buckets=8)
    tcfg = trainer_config_from(cfg, compile=False)
    assert tcfg.loss == "nll" and tcfg.share_prompts
    g = torch.Generator().manual_seed(4)
    samples = []
    for i in range(6):
        n = 4 + i
        tokens = torch.randint(6, 90, (n,), generator=g).tolist()
        mask = tuple(int(x) for x in (torch.rand(n - (i % 2 == 0), generator=g) > 0.3))
        samples.append(Sample(prompt="", tokens=tokens, response_length=len(mask), loss_mask=mask))
    assert {s.prompt_length for s in samples} == {0, 1}
    mbs = build_micro_batches(samples, token_budget=32, bucket_size=8, pad_id=0)
    comp = build_components(tiny_model_config("llama"), tcfg)
    fut = forward_backward(comp, mbs, tcfg)
    opt, _ = optim_step(comp, TrainingState(), tcfg, num_tokens=fut.num_tokens)
    want = {**fut.result(), **opt.result()}
    comp = build_components(tiny_model_config("llama"), tcfg)
    backend = LocalBackend(comp, tcfg, pad_id=0)
    datums, extra = to_datums(samples, [0.0] * len(samples))
    got = {**backend.forward_backward(datums, "nll", extra).result().metrics, **backend.optim_step().result()}
    assert got == want and got["num_tokens"] == sum(sum(s.effective_loss_mask[s.prompt_length == 0:])
                                                    for s in samples)
