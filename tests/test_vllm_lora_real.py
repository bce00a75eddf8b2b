"""A real vLLM 0.32 (CPU build, `.venv-vllm`) serving LoRA adapters through `engines.vllm.VLLMEngine` (issue 38
items 3-4): `--enable-lora`, its /v1/load_lora_adapter route with PEFT's folder, generation naming the adapter,
/v1/unload_lora_adapter. Each request's log-probs equal a float64 forward of the base with that adapter merged
(PEFT's merge_and_unload), with two adapters' requests in flight together, and an unloaded name is a 404.

Not asserted: requests for the base model on this LoRA-enabled CPU server. vLLM 0.32's CPU build served them with
the adapter in its last slot (their log-probs matched the "mlp" reference to 4e-6 while "qv" ran beside them),
consistent with a row without an adapter (index -1) gathering the last slot; the embedded engine's per-row
gather (tests/test_multi_lora.py) is the path that mixes base rows in.

One short server (start-up is a minute or two on two cores); tolerance 1e-4 as in test_engine_vllm_real.py (the
engine runs float32)."""

from __future__ import annotations

import copy

import pytest
import torch
import trio
from engine_support import random_peft_adapter
from vllm_support import start_server, stop_server, write_model_folder

from engines.embedded.launch import free_port
from engines.protocol import EngineError, SamplingParams
from engines.vllm import VLLMEngine

pytestmark = pytest.mark.slow
TOL = 1e-4
PROMPTS = [[1, 20, 21, 22], [1, 7, 8, 9, 10]]


def peft_adapter(base, folder, seed: int, targets: list[str]):
    """A rank-8 PEFT adapter with random A and B saved to `folder`; returns the merged float64 reference."""
    pm = random_peft_adapter(copy.deepcopy(base), folder, r=8, alpha=16, targets=targets, seed=seed, scale=0.05)
    return pm.merge_and_unload().double().eval()


def check(model, completion) -> None:
    """Greedy: the tokens are the reference's argmax, the log-probs its temperature-1 log-probs (TOL)."""
    ids = completion.prompt_ids + completion.output_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(completion.prompt_ids) - 1:-1]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion.output_ids)[:, None])[:, 0]
    assert (lp - torch.tensor(completion.logprobs, dtype=torch.float64)).abs().max().item() <= TOL
    assert logits.argmax(-1).tolist() == completion.output_ids


def test_vllm_serves_peft_adapters_by_name(tmp_path):
    base, _ = write_model_folder(tmp_path / "model", seed=0)
    refs = {"qv": peft_adapter(base, tmp_path / "qv", 1, ["q_proj", "v_proj"]),
            "mlp": peft_adapter(base, tmp_path / "mlp", 2, ["gate_proj", "up_proj", "down_proj"])}
    port = free_port()
    proc = start_server(tmp_path / "model", port, tmp_path / "server.log",
                        extra=("--enforce-eager", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
                        env_extra={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    eng = VLLMEngine(f"http://127.0.0.1:{port}", str(tmp_path / "model"))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        async def go():
            for name in ("qv", "mlp"):
                await eng.load_adapter(name, str(tmp_path / name))
            out = {}

            async def one(name):
                out[name] = await eng.generate(PROMPTS, params, adapter=name)

            async with trio.open_nursery() as nursery:  # both in flight together
                for name in refs:
                    nursery.start_soon(one, name)
            await eng.unload_adapter("qv")
            with pytest.raises(EngineError) as err:
                await eng.generate(PROMPTS, params, adapter="qv")
            return out, err.value

        out, err = trio.run(go)
    finally:
        stop_server(proc)
    for name, groups in out.items():
        for (c,) in groups:
            check(refs[name], c)
    assert out["qv"][0][0].logprobs != out["mlp"][0][0].logprobs  # each adapter gives its own answer
    assert err.status == 404 and "qv" in str(err)
