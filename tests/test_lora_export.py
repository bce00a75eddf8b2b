"""`python -m trainer export` of a LoRA run (issue 38 item 5): the merged model at --out, or with --adapter a PEFT
adapter folder whose base_model_name_or_path is the base exported beside it. An sft+rl run with LoRA in both
phases: RL's adapters sit on the SFT result (the SFT adapters merged into the start model), which is what the
exported base must hold. PEFT loads the folder unchanged; its logits equal the merged export's and its greedy
answers equal the embedded engine's serving the adapter on the exported base (and the merged folder)."""

from __future__ import annotations

import json

import pytest
import torch
import trio

from engines.local import LocalEngine
from engines.protocol import SamplingParams
from trainer.cli import load_run_config, main, run

PROMPTS = [[1, 20, 21, 22], [1, 7, 8, 9, 10], [1, 40, 41]]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_run")
    cfg = load_run_config("configs/demo.toml", [
        f"output_dir={json.dumps(str(out))}", "engines.in_process=true", "sft.num_steps=3", "rl.num_steps=2",
        "rl.rollout.rollout_batch_size=4", "rl.rollout.n_samples_per_prompt=4", "eval.limit=4",
        "rl.lora={rank = 4, alpha = 8.0}", "rl.optim.lr=5e-2", "rl.rollout.max_truncated_steps=0",
        'data.reward="test_lora:even_token_reward"',  # rewards that differ within a group: RL moves B
        "sft.lora={rank = 4, alpha = 8.0}", "sft.optim.lr=5e-2"], mode="sft+rl")
    run("sft+rl", cfg)
    return out


def export(run_dir, *extra) -> int:
    return main(["export", "--config", str(run_dir / "config.toml"), *extra])


def greedy_engine(folder, adapter_folder=None) -> list[list[int]]:
    eng = LocalEngine(str(folder), seed=0)
    try:
        async def go():
            if adapter_folder is not None:
                await eng.load_adapter("exported", str(adapter_folder))
            groups = await eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10),
                                        adapter="exported" if adapter_folder is not None else None)
            return [g[0].output_ids for g in groups]

        return trio.run(go)
    finally:
        eng.close()


def test_adapter_export_loads_in_peft_and_answers_as_the_engine(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert export(lora_run, "--adapter", "--out", str(adapter)) == 0
    assert export(lora_run, "--out", str(merged)) == 0
    base = tmp_path / "adapter-base"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    assert {"adapter_model.safetensors", "tokenizer_config.json"} <= {p.name for p in adapter.iterdir()}
    assert (base / "config.json").is_file() and (base / "tokenizer_config.json").is_file()

    stock = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(stock, str(adapter)).eval()
    plain_merged = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(str(lora_run / "init_model"), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 21, 22, 40, 41, 7, 90]])
    with torch.no_grad():
        got, want = peft_model(input_ids=ids).logits, plain_merged(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)(input_ids=ids).logits
        start_logits = start(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5  # the adapters on the base = the merged export
    assert (got - base_logits).abs().max().item() > 1e-3  # RL's adapters are in the folder
    assert (base_logits - start_logits).abs().max().item() > 1e-3  # the base is SFT's result, not the start model

    answers = []
    for p in PROMPTS:
        with torch.no_grad():
            out = peft_model.generate(input_ids=torch.tensor([p]), max_new_tokens=10, do_sample=False)
        answers.append(out[0, len(p):].tolist())
    assert greedy_engine(base, adapter) == answers  # the engine serving the adapter on the exported base
    assert greedy_engine(merged) == answers  # and the merged export


def test_adapter_export_of_a_full_checkpoint_is_refused(lora_run, tmp_path, capsys):
    """--adapter on a checkpoint without LoRA: exit 2, an error naming the fix, nothing written. (The run's SFT
    checkpoint is LoRA too, so a full one is made: a full export folder is not a checkpoint; a plain SFT run.)"""
    cfg = load_run_config("configs/demo.toml", [f"output_dir={json.dumps(str(tmp_path / 'full'))}",
                                                "engines.in_process=true", "sft.num_steps=1", "eval.limit=2"],
                          mode="sft")
    run("sft", cfg)
    out = tmp_path / "adapter"
    assert main(["export", "--config", str(tmp_path / "full" / "config.toml"), "--adapter", "--out", str(out)]) == 2
    assert "trains no LoRA adapters" in capsys.readouterr().err and not out.exists()


def test_a_run_can_start_from_a_lora_checkpoint(lora_run, tmp_path):
    """[model] checkpoint = a LoRA run's RL phase: the new run starts from that run's merged weights (SFT's result
    with RL's adapters merged), the same tensors as `export` writes, not from the adapters' base alone."""
    from safetensors.torch import load_file

    from trainer.backend.export import start_folder
    from trainer.run import prepare_model_folder

    merged = tmp_path / "merged"
    assert export(lora_run, "--out", str(merged)) == 0
    cfg = load_run_config("configs/demo.toml", [f"output_dir={json.dumps(str(tmp_path / 'next'))}",
                                                f"model.checkpoint={json.dumps(str(lora_run / 'rl'))}"], mode="rl")
    start = start_folder(cfg, prepare_model_folder(cfg))
    assert start == tmp_path / "next" / "start_model"
    got, want = load_file(start / "model.safetensors"), load_file(merged / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    sft_base = tmp_path / "sft-base"
    assert main(["export", "--config", str(lora_run / "config.toml"), "--checkpoint", str(lora_run / "sft"),
                 "--out", str(sft_base)]) == 0
    sft = load_file(sft_base / "model.safetensors")
    assert max((got[k] - sft[k]).abs().max().item() for k in sft) > 1e-4  # RL's adapters are in the start weights
