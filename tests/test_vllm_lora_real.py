"""A real vLLM 0.32 (CPU build, `.venv-vllm`) with LoRA (issue 38 items 3-4), one server for the module (--enable-lora
--max-lora-rank 8 --max-loras 2, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; its start-up is the slow part). The tests run
in file order: the first serves PEFT folders over the base as written, the second syncs a trainer into it (and
replaces the base by a merged sync).

Serving PEFT folders through `engines.vllm.VLLMEngine`: `--enable-lora`, its /v1/load_lora_adapter route with PEFT's
folder, generation naming the adapter, /v1/unload_lora_adapter. Each request's log-probs equal a float64 forward of
the base with that adapter merged (PEFT's merge_and_unload), with two adapters' requests in flight together, and an
unloaded name is a 404.

Not asserted: requests for the base model on this LoRA-enabled CPU server. vLLM 0.32's CPU build served them with
the adapter in its last slot (their log-probs matched the "mlp" reference to 4e-6 while "qv" ran beside them),
consistent with a row without an adapter (index -1) gathering the last slot; the embedded engine's per-row gather
(tests/test_multi_lora.py) is the path that mixes base rows in.

Adapter-only weight sync: the trainer's sender (lora="auto") sees that the vLLM server (--enable-lora,
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) lists "lora_adapter" among its weight formats and sends the adapters alone: the
first sync the base (unmerged) and the adapters, every later one the adapters' A and B only, by the gloo broadcast
of our vLLM plugin; no folder is written. The worker builds vLLM's LoRA model from the tensors under the name
"policy" and replaces it on each sync. Checked, against a float64 forward of the trainer's model with the adapters
merged (tolerance 1e-4: engine vs trainer in fp32, design.md): greedy tokens and log-probs of requests naming
"policy", and of requests naming no adapter on the synced engine object and on a copy pickled before the first sync
(as the rollout process's is): their default adapter. The second sync replaces the adapter (the first reference is
then off), and `last_sync_bytes` (the RL loop's `sync/bytes`) equals the adapter's bytes from the second sync on;
requests naming the base (the served model) answer as the trainer's base, unmerged. An adapter wider than the
server's --max-lora-rank fails the sync before anything is loaded, naming the flag, and "policy" keeps its last
version. A merged sync afterwards (lora="merged") clears the default and unregisters "policy": requests naming no
adapter get the merged weights, naming "policy" is a 404. Last, a run with train_unembed: its lm_head, trained
outside the adapters, goes with them on every sync (sync bytes = adapters + lm_head; vLLM reloads that one layer),
and "policy" is registered again.

Base and adapter requests are never in flight together: vLLM 0.32's CPU build served a base row beside an adapter
row with the adapter (above).

Tolerance 1e-4 as in test_engine_vllm_real.py (the engine runs float32)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import trio
from engine_support import perturb_lora, random_peft_adapter
from vllm_support import start_server, stop_server, tiny_qwen2, tiny_qwen2_config, write_model_folder

from engines.embedded.launch import free_port
from engines.protocol import EngineError, SamplingParams
from engines.vllm import VLLMEngine
from engines.weight_sync.wire import WeightSyncError
from trainer.backend.lora import ADAPTER, inject, lora_layers
from trainer.config import LoRAConfig
from trainer.weight_sync import WeightSyncSender
from trainer.weight_sync.common import gathered_weights, named_weights

pytestmark = pytest.mark.slow
TOL = 1e-4
PROMPTS = [[1, 20, 21, 22], [1, 7, 8, 9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, folder, base model) of one LoRA-enabled vLLM serving a seed-0 tiny Qwen2 (another model than the
    trainer's)."""
    tmp = tmp_path_factory.mktemp("vllm_lora")
    base, _ = write_model_folder(tmp / "model", seed=0)
    port = free_port()
    proc = start_server(tmp / "model", port, tmp / "server.log",
                        extra=("--enforce-eager", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
                        env_extra={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        yield f"http://127.0.0.1:{port}", str(tmp / "model"), base
    finally:
        stop_server(proc)


def lora_trainer(*, train_unembed: bool = False, rank: int = 4):
    """The trainer's model: another base than the served folder's (seed 5, not 0), rank-4 adapters on every
    linear layer, with values."""
    trainer, _ = tiny_qwen2(seed=5)
    inject(trainer, LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules="all-linear", train_unembed=train_unembed))
    perturb(trainer, 1)
    return trainer


def perturb(model, seed: int) -> None:
    perturb_lora(model, seed, adapter_scale=0.05, base_scale=0.02)


def reference(model, merged: bool = True):
    """A float64 Qwen2 with `model`'s engine weights: the adapters merged (W + alpha / r B A), or the base alone."""
    from transformers import Qwen2ForCausalLM

    ref = Qwen2ForCausalLM(tiny_qwen2_config()).double().eval()
    weights = dict(gathered_weights(model, torch.float64)) if merged else {
        n: p.detach().double() for n, p in named_weights(model)}
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ref


def check(ref, groups) -> float:
    """Greedy tokens are the reference's argmax and log-probs its log-probs (TOL); returns the largest gap."""
    worst = 0.0
    for (c,) in groups:
        ids = c.prompt_ids + c.output_ids
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([ids])).logits[0, len(c.prompt_ids) - 1:-1]
        lp = logits.log_softmax(-1).gather(-1, torch.tensor(c.output_ids)[:, None])[:, 0]
        gap = (lp - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
        assert gap <= TOL and logits.argmax(-1).tolist() == c.output_ids, (gap, c.output_ids)
        worst = max(worst, gap)
    return worst


def stale_gap(ref, groups) -> float:
    c = groups[0][0]
    ids = c.prompt_ids + c.output_ids
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([ids])).logits[0, len(c.prompt_ids) - 1:-1]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(c.output_ids)[:, None])[:, 0]
    return (lp - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()


def peft_adapter(base, folder, seed: int, targets: list[str]):
    """A rank-8 PEFT adapter with random A and B saved to `folder`; returns the merged float64 reference."""
    pm = random_peft_adapter(copy.deepcopy(base), folder, r=8, alpha=16, targets=targets, seed=seed, scale=0.05)
    return pm.merge_and_unload().double().eval()


def check_one(model, completion) -> None:
    """Greedy: the tokens are the reference's argmax, the log-probs its temperature-1 log-probs (TOL)."""
    ids = completion.prompt_ids + completion.output_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(completion.prompt_ids) - 1:-1]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion.output_ids)[:, None])[:, 0]
    assert (lp - torch.tensor(completion.logprobs, dtype=torch.float64)).abs().max().item() <= TOL
    assert logits.argmax(-1).tolist() == completion.output_ids


def test_vllm_serves_peft_adapters_by_name(server, tmp_path):
    url, folder, base = server
    refs = {"qv": peft_adapter(base, tmp_path / "qv", 1, ["q_proj", "v_proj"]),
            "mlp": peft_adapter(base, tmp_path / "mlp", 2, ["gate_proj", "up_proj", "down_proj"])}
    eng = VLLMEngine(url, folder)

    async def go():
        for name in ("qv", "mlp"):
            await eng.load_adapter(name, str(tmp_path / name))
        out = {}

        async def one(name):
            out[name] = await eng.generate(PROMPTS, GREEDY, adapter=name)

        async with trio.open_nursery() as nursery:  # both in flight together
            for name in refs:
                nursery.start_soon(one, name)
        await eng.unload_adapter("qv")
        with pytest.raises(EngineError) as err:
            await eng.generate(PROMPTS, GREEDY, adapter="qv")
        await eng.unload_adapter("mlp")  # the next test starts from the base alone
        return out, err.value

    out, err = trio.run(go)
    for name, groups in out.items():
        for (c,) in groups:
            check_one(refs[name], c)
    assert out["qv"][0][0].logprobs != out["mlp"][0][0].logprobs  # each adapter gives its own answer
    assert err.status == 404 and "qv" in str(err)


def test_adapter_only_sync_to_vllm(server):
    url, folder, _ = server
    trainer = lora_trainer()
    base_ref = reference(trainer, merged=False)
    base_bytes = sum(p.nbytes for _, p in named_weights(trainer))
    adapter_bytes = sum(layer.lora_A[ADAPTER].weight.nbytes + layer.lora_B[ADAPTER].weight.nbytes
                        for layer in lora_layers(trainer).values())
    gaps = []
    eng = VLLMEngine(url, folder)
    copy = pickle.loads(pickle.dumps(eng))  # the rollout process's copy: pickled before the first sync
    sender = WeightSyncSender(trainer, [eng], timeout_s=120.0)  # lora="auto"
    try:
        assert "lora_adapter" in trio.run(eng.weight_formats)
        sender.init_group()
        assert sender.adapter_sync  # "auto" chose the adapters for this vLLM

        assert sender.sync() == 1
        assert sender.last_sync_bytes == base_bytes + adapter_bytes  # the first: the base, unmerged, and adapters
        assert eng.default_adapter == "policy"
        first = reference(trainer)
        named = trio.run(lambda: eng.generate(PROMPTS, GREEDY, adapter="policy"))
        gaps.append(check(first, named))
        check(first, trio.run(lambda: eng.generate(PROMPTS, GREEDY)))  # no name: the default adapter

        perturb(trainer, 2)
        assert sender.sync() == 2
        assert sender.last_sync_bytes == adapter_bytes  # sync/bytes = the adapter's bytes
        second = reference(trainer)
        replaced = trio.run(lambda: eng.generate(PROMPTS, GREEDY, adapter="policy"))
        gaps.append(check(second, replaced))
        assert stale_gap(first, replaced) > 0.1  # the second sync replaced the first adapter
        check(second, trio.run(lambda: copy.generate(PROMPTS, GREEDY)))  # the copy learnt the default from vLLM
        assert copy.default_adapter == "policy" and trio.run(copy.get_weight_version) == 2
        check(base_ref, trio.run(lambda: eng.generate(PROMPTS, GREEDY, adapter=folder)))  # the base, unmerged

        sender.close()  # the same base with rank-16 adapters: more than the server's --max-lora-rank
        sender = WeightSyncSender(lora_trainer(rank=16), [eng], timeout_s=120.0, weight_version=2)
        sender.init_group()
        with pytest.raises(WeightSyncError, match="max-lora-rank 8; restart it with --max-lora-rank >= 16"):
            sender.sync()
        check(second, trio.run(lambda: eng.generate(PROMPTS, GREEDY, adapter="policy")))  # the last good version

        merged = WeightSyncSender(trainer, [eng], timeout_s=120.0, lora="merged", weight_version=2)
        sender.close()
        merged.init_group()
        assert not merged.adapter_sync and merged.sync() == 3
        assert eng.default_adapter is None and merged.last_sync_bytes == base_bytes
        later = VLLMEngine(url, folder)
        check(second, trio.run(lambda: later.generate(PROMPTS, GREEDY)))  # the merged weights as the base
        assert later.default_adapter is None
        with pytest.raises(EngineError) as err:
            trio.run(lambda: eng.generate(PROMPTS, GREEDY, adapter="policy"))
        assert err.value.status == 404
        merged.close()

        unembed = lora_trainer(train_unembed=True)
        lm_head_bytes = unembed.get_output_embeddings().weight.nbytes
        sender = WeightSyncSender(unembed, [eng], timeout_s=120.0, weight_version=3)
        sender.init_group()
        assert sender.adapter_sync and sender.sync() == 4 and eng.default_adapter == "policy"
        check(reference(unembed), trio.run(lambda: eng.generate(PROMPTS, GREEDY)))  # base and adapters re-sent
        perturb(unembed, 3)
        assert sender.sync() == 5 and sender.last_sync_bytes == adapter_bytes + lm_head_bytes
        gaps.append(check(reference(unembed), trio.run(lambda: eng.generate(PROMPTS, GREEDY))))
        print(f"vLLM after adapter syncs vs the float64 merged forward: max |log-prob gap| {max(gaps):.1e}; sync "
              f"bytes: first {base_bytes + adapter_bytes}, then {adapter_bytes} (adapters; merged: {base_bytes})")
    finally:
        sender.close()
