"""Users' models: SFT -> export -> RL through files, tied embeddings kept tied, on a tiny Qwen2 of the real-shape
run's architecture (the 0.5B-shaped run itself is bench/bench_real_shape.py, under `make bench`)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.bench_real_shape import (
    CONFIG,
    IM_END,
    QWEN05B_SHAPE,
    ROOT,
    build_chatml_tokenizer,
    run_pipeline,
    training_texts,
    write_model_folder,
)
from trainer.backend.export import export_checkpoint, resolve_checkpoint, start_folder
from trainer.backend.steps import build_components, compute_logprobs, trainer_config_from
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import ModelConfig, OptimConfig, RLTrainingConfig, RunConfig, SFTTrainingConfig
from trainer.data.buffer import DataSpec, load_prompts
from trainer.rollout.samples import prompt_token_ids
from trainer.sft import run_sft_training
from trainer.types import Sample

# Same architecture as Qwen2.5-0.5B (Qwen2, GQA 2:1, tied embeddings, a vocab padded past the tokenizer's).
TINY = dict(vocab_size=1536, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _sft_run(tmp_path, folder, steps=3):
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = load_prompts(DataSpec(str(ROOT / "data" / "gsm8k_style_train.parquet"), prompt_key="question",
                                    answer_key="solution", system_prompt="Be exact."), cache_dir=str(tmp_path / "c"))
    convs = [p.metadata["messages"] for p in prompts.take(range(32))]
    cfg = SFTTrainingConfig(num_steps=steps, batch_size=8, max_length=96, token_budget=512, micro_batch_buckets=64,
                            output_dir=str(tmp_path / "sft"), optim=OptimConfig(lr=3e-3))
    tcfg = trainer_config_from(cfg, compile=False)
    comp, state, _ = run_sft_training(str(folder), convs, cfg, tokenizer=tok, trainer_config=tcfg)
    return comp, tok, convs


def _logprob_batch(tok, convs, vocab, seed):
    """Token rows of real conversations plus a few random tokens past the tokenizer's ids (rows of the padded
    vocab the tied lm_head also scores)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for c in convs[:6]:
        ids = tok.apply_chat_template(c, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:60]
        extra = torch.randint(len(tok), vocab, (4,), generator=g).tolist()
        samples.append(Sample(prompt="", tokens=tuple(ids + extra), response_length=len(ids) + 3))
    return samples


def test_tiny_config_matches_the_real_shape_architecture():
    assert QWEN05B_SHAPE["tie_word_embeddings"] and QWEN05B_SHAPE["vocab_size"] == 151936
    assert QWEN05B_SHAPE["num_attention_heads"] // QWEN05B_SHAPE["num_key_value_heads"] == 7
    tok = build_chatml_tokenizer(training_texts())
    assert len(tok) < TINY["vocab_size"] and tok.unk_token is None  # byte-level: any text, no unk
    text = "Ava has 1,234 apples. ✓ ünïcode\n#### 1,234"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # A data set's system prompt opens every rollout (and evaluation) prompt.
    ids = prompt_token_ids(tok, "hi", chat=True, system="Be exact.")
    assert tok.decode(ids) == "<|im_start|>system\nBe exact.<|im_end|>\n" + chat
    assert prompt_token_ids(tok, "hi", chat=True) == tok(chat)["input_ids"]


def test_export_reloads_with_transformers_and_gives_the_trainers_logprobs(tmp_path):
    folder = write_model_folder(tmp_path / "init", seed=3, **TINY)
    init_embed = AutoModelForCausalLM.from_pretrained(folder).model.embed_tokens.weight.detach().clone()
    comp, tok, convs = _sft_run(tmp_path, folder)
    lm = comp.model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # one parameter under FSDP2 after training

    out = export_checkpoint(tmp_path / "sft", folder, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # re-tied by transformers
    assert (model.model.embed_tokens.weight - init_embed).abs().max() > 1e-4  # trained weights, not the init

    # Chat template, special tokens and stop ids travel with the folder.
    tok2 = AutoTokenizer.from_pretrained(out)
    assert tok2.chat_template == tok.chat_template and tok2.eos_token == IM_END
    assert tok2.pad_token == tok.pad_token and tok2.all_special_tokens == tok.all_special_tokens
    assert tok2.apply_chat_template(convs[0], tokenize=False) == tok.apply_chat_template(convs[0], tokenize=False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == \
        [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids("<|endoftext|>")]

    # Same log-probs: the trainer's fused lm_head path on its FSDP2 model vs transformers on the exported folder.
    samples = _logprob_batch(tok, convs, TINY["vocab_size"], seed=torch.seed() % 2**31)
    mbs = build_micro_batches(samples, token_budget=512, bucket_size=64, pad_id=tok.pad_token_id)
    ours = torch.cat([lp[mb.loss_mask.bool()] for lp, mb in zip(compute_logprobs(comp, mbs), mbs)])
    ref = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            ref.append(logp.gather(-1, ids[0, 1:, None])[:, 0][s.prompt_length - 1:])
    ref = torch.cat(ref)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=0)  # fp32 log-prob tolerance


def test_rl_can_start_from_a_checkpoint_and_bad_exports_are_named(tmp_path):
    folder = write_model_folder(tmp_path / "init", seed=1, **TINY)
    _sft_run(tmp_path, folder, steps=1)
    ckpt = resolve_checkpoint(tmp_path / "sft")
    assert ckpt.name == "step_00000001" and resolve_checkpoint(ckpt) == ckpt
    cfg = RunConfig(output_dir=str(tmp_path / "run"), model=ModelConfig(path=str(folder),
                                                                      checkpoint=str(tmp_path / "sft")))
    start = start_folder(cfg, folder)
    assert start == tmp_path / "run" / "start_model"
    assert start_folder(RunConfig(model=ModelConfig(path=str(folder))), folder) == folder
    a = build_components(start, trainer_config_from(RLTrainingConfig(), compile=False))
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "start_model")
    for name, p in a.model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(b.named_parameters())[name], atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="nowhere: does not exist"):
        export_checkpoint(tmp_path / "nowhere", folder, tmp_path / "x")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        export_checkpoint(tmp_path / "init", folder, tmp_path / "x")
    other = write_model_folder(tmp_path / "other", **{**TINY, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"no weights for \['model.layers.2"):
        export_checkpoint(ckpt, other, tmp_path / "x")


def test_cli_sft_export_rl_on_the_tiny_model(tmp_path):
    """The real-shape pipeline end to end (three CLI processes) on the tiny model; after every weight sync the
    engine's log-probs equal the trainer's, which fails if the tied lm_head arrives stale."""
    # A random model earns no GSM8K reward, and zero advantages would leave the weights (and the sync) unchanged:
    # a reward that varies within each group (the `module:function` hook, from a file) makes every step move them.
    reward = tmp_path / "varying_reward.py"
    reward.write_text("def reward(sample):\n    return float(len(sample.response) % 3)\n")
    figures = run_pipeline(tmp_path / "run", shape=TINY, timeout_s=900,
                           overrides=["--set", "engines.threads=1", "--set", "sft.num_steps=3",
                                      "--set", "rl.num_steps=3", "--set", "rl.optim.lr=1e-3",
                                      "--set", "rl.rollout.n_samples_per_prompt=4",
                                      "--set", f'data.reward="{reward}:reward"'])
    assert figures["sft"]["steps"] == 3 and figures["rl"]["steps"] == 3
    assert all(row["grad_norm"] > 0 for row in figures["rl"]["per_step"]), figures["rl"]  # the weights move
    export = tmp_path / "run" / "export"
    assert (export / "model.safetensors").is_file() and (export / "tokenizer.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rl_steps"] == 3 and "accuracy_after_rl" in summary  # the mean of that reward, here
    print("\nRL steps:", figures["rl"]["per_step"])
    for row in figures["rl"]["per_step"]:
        assert row["mismatch/logprob_abs_diff_max"] < 1e-4, figures["rl"]
    # A missing checkpoint is a clear CLI error, not a traceback.
    proc = subprocess.run([sys.executable, "-m", "trainer", "export", "--config", str(CONFIG), "--set",
                           f'output_dir="{tmp_path / "empty"}"', "--set", f'model.path="{export}"'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no checkpoint under rl/ or sft/" in proc.stderr, proc.stderr[-2000:]
