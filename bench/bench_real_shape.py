"""A real-shape run from the command line: a Qwen2.5-0.5B-shaped model through SFT -> export -> RL on this machine.

    make bench                                          (pytest-benchmark; figures in extra_info and results/)
    .venv/bin/python bench/bench_real_shape.py          (the same run, figures printed)
    .venv/bin/python bench/bench_real_shape.py --init   (only write the model folder the config points at)

The model has Qwen2.5-0.5B's published shape (vocab 151,936, hidden 896, 24 layers, 14 query / 2 key-value heads,
MLP 4,864, tied embeddings), random-initialised by transformers and saved as a Hugging Face folder with a byte-level
BPE tokenizer trained here on the shipped data (Qwen's ChatML special tokens and chat template; nothing is
downloaded). configs/qwen05b_shape.toml trains it on data/gsm8k_style_*.parquet (fields `question` / `solution`)
with the gsm8k reward. Three CLI processes, each its own peak: `sft`, `export` (a Hugging Face folder from the SFT
checkpoint), `rl` starting from that folder (embedded engine, weight sync every step). Figures: wall time and peak
resident memory of each process tree (trainer + engine), SFT step time, RL generate / train / sync times, and
the engine-vs-trainer log-prob mismatch after each sync, held to the tolerance of the run's dtypes (1e-4 in
float32, 5e-2 in bfloat16, design.md's table; tied embeddings must arrive tied).

The pipeline is the same for the tiny model of the same architecture (tests/test_real_shape.py runs it there).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the project root (trainer, engines) and bench/ itself (its helpers are top-level modules), whether this runs as a
# script, is collected by pytest, or is imported as bench.bench_real_shape by tests/test_real_shape.py on its own
for _path in (ROOT, ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _proc import run_with_peak_rss  # noqa: E402

CONFIG = ROOT / "configs" / "qwen05b_shape.toml"
RESULTS = ROOT / "bench" / "results" / "real_shape_cpu.json"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5's ChatML template, without its default system prompt. Prefixes of a conversation render as token prefixes,
# which the SFT loss mask needs.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Engine-vs-trainer log-prob mismatch tolerance, abs (docs: design.md's tolerance table), per compute dtype.
MISMATCH_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
QWEN05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                     tie_word_embeddings=True, rms_norm_eps=1e-6)


# ----------------------------------------------------------------------------------------------- model folder
def training_texts() -> list[str]:
    """What the tokenizer is trained on: the shipped GSM8K-style sets and the chat template's role words."""
    import pyarrow.parquet as pq

    texts = ["system", "user", "assistant", "Solve the problem. End with #### and the answer."]
    for split in ("train", "test"):
        t = pq.read_table(ROOT / "data" / f"gsm8k_style_{split}.parquet", columns=["question", "solution"])
        texts += t.column("question").to_pylist() + t.column("solution").to_pylist()
    return texts


def build_chatml_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer (any text encodes, no unk) with Qwen's special tokens and ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    return fast


def write_model_folder(folder: str | os.PathLike, *, seed: int = 0, **shape) -> Path:
    """A random-initialised Qwen2 causal LM (Qwen2.5-0.5B's shape unless `shape` overrides keys) saved by
    transformers with the tokenizer and a generation config whose eos ids are the chat's end-of-turn and
    end-of-text (as Qwen2.5-Instruct's)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    tok = build_chatml_tokenizer(training_texts())
    eos = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
    config = Qwen2Config(**{**QWEN05B_SHAPE, **shape}, bos_token_id=None, eos_token_id=eos[0],
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------------- tolerance
def run_dtypes(device_type: str, param_dtype: str | None = None) -> dict[str, str]:
    """The compute dtypes of a run on `device_type`: the trainer's ([trainer].param_dtype, default bfloat16 on
    CUDA and float32 on the CPU) and the embedded engine's (its own default: the same rule)."""
    default = "bfloat16" if device_type == "cuda" else "float32"
    return {"trainer": param_dtype or default, "engine": default}


def mismatch_tolerance(dtypes: dict[str, str]) -> float:
    """The engine-vs-trainer log-prob tolerance of a run: the looser of its two sides' dtypes (a bf16 engine
    differs from an fp32 trainer by the bf16 rounding of its own forward)."""
    unknown = sorted(set(dtypes.values()) - MISMATCH_TOL.keys())
    if unknown:
        raise ValueError(f"dtypes={dtypes}: no engine-vs-trainer tolerance for {unknown}; known: "
                         f"{sorted(MISMATCH_TOL)} (add the dtype to MISMATCH_TOL with its measured bound)")
    return max(MISMATCH_TOL[d] for d in dtypes.values())


def mismatch_failures(per_step: Sequence[dict], tol: float) -> list[str]:
    """The RL steps whose max engine-vs-trainer log-prob difference reaches `tol` (a step without a figure: none
    measured, e.g. nothing was sampled)."""
    key = "mismatch/logprob_abs_diff_max"
    return [f"step {i}: {key} = {row[key]:.3g} >= {tol:g}" for i, row in enumerate(per_step)
            if row.get(key) is not None and row[key] >= tol]


def _param_dtype(out: Path) -> str | None:
    """[trainer].param_dtype of the run's resolved config (<out>/config.toml, written by every CLI run)."""
    import tomllib

    return tomllib.loads((out / "config.toml").read_text()).get("trainer", {}).get("param_dtype")


# ----------------------------------------------------------------------------------------------- measuring
def run_phase(args: Sequence[str], *, env: dict, timeout_s: float, log: Path) -> dict:
    """Run `python -m trainer <args>`; returns wall seconds and the peak RSS of its process tree (0.2 s samples)."""
    t0 = time.perf_counter()
    rc, peak = run_with_peak_rss([sys.executable, "-m", "trainer", *args], log=log, timeout_s=timeout_s, cwd=ROOT,
                                 env=env)
    if rc != 0:
        raise RuntimeError(f"python -m trainer {' '.join(args)} exited {rc}; log {log}:\n{log.read_text()[-4000:]}")
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_gib": round(peak / 2**30, 2)}


def _rows(path: Path) -> list[dict]:
    """The training steps' rows (not the evaluation-only row of step 0)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def run_pipeline(out: str | os.PathLike, *, config: Path = CONFIG, overrides: Sequence[str] = (),
                 shape: dict | None = None, timeout_s: float = 3600) -> dict:
    """SFT -> export -> RL through three CLI processes; returns the figures (see the module docstring)."""
    out = Path(out)
    # Not <out>/init_model: that is the preset folder a fresh start removes, and a [model] path inside what a fresh
    # start removes is refused (trainer.run_folder).
    init = out / "base_model"
    t0 = time.perf_counter()
    if not (init / "config.json").is_file():
        write_model_folder(init, **(shape or {}))
    init_s = round(time.perf_counter() - t0, 1)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1"}
    common = ["--config", str(config), "--set", f'output_dir="{out}"', "--set", f'model.path="{init}"', *overrides]
    figures: dict = {"init_model_s": init_s}
    figures["sft"] = run_phase(["sft", *common], env=env, timeout_s=timeout_s, log=out / "sft.log")
    export = out / "export"
    figures["export"] = run_phase(["export", *common, "--checkpoint", str(out / "sft"), "--out", str(export)],
                                  env=env, timeout_s=timeout_s, log=out / "export.log")
    rl_common = [c if not c.startswith("model.path=") else f'model.path="{export}"' for c in common]
    figures["rl"] = run_phase(["rl", *rl_common], env=env, timeout_s=timeout_s, log=out / "rl.log")
    sft_rows, rl_rows = _rows(out / "sft" / "metrics.jsonl"), _rows(out / "rl" / "metrics.jsonl")
    times = [b["time"] - a["time"] for a, b in zip(sft_rows, sft_rows[1:])]
    figures["sft"].update(steps=len(sft_rows), step_s=round(sum(times) / len(times), 2) if times else None,
                          loss=[round(r["loss"], 4) for r in sft_rows])
    keys = ("time_generate_s", "time_train_s", "time_sync_s", "mismatch/logprob_abs_diff_max",
            "mismatch/logprob_abs_diff_mean", "reward_mean", "grad_norm")
    figures["rl"].update(steps=len(rl_rows), per_step=[{k: r.get(k) for k in keys} for r in rl_rows])
    import torch

    figures["dtypes"] = run_dtypes("cuda" if torch.cuda.is_available() else "cpu", _param_dtype(out))
    figures["mismatch_tolerance"] = mismatch_tolerance(figures["dtypes"])
    return figures


# ----------------------------------------------------------------------------------------------- benchmark
@pytest.mark.slow
def test_real_shape_sft_export_rl(benchmark, request, tmp_path):
    """make bench only: ~10 GiB and minutes on a CPU (skipped when benchmarks are disabled, as in `make test`)."""
    if request.config.getoption("benchmark_disable"):
        pytest.skip("the real-shape run is heavy: it runs under `make bench` (or python bench/bench_real_shape.py)")
    figures = benchmark.pedantic(lambda: run_pipeline(tmp_path / "run"), rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
    bad = mismatch_failures(figures["rl"]["per_step"], figures["mismatch_tolerance"])
    assert not bad, f"engine-vs-trainer mismatch over the {figures['dtypes']} tolerance: {bad}"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "qwen05b_shape"))
    ap.add_argument("--init", action="store_true", help="only write the model folder <out>/base_model")
    a = ap.parse_args()
    if a.init:
        print(write_model_folder(Path(a.out) / "base_model"))
    else:
        result = run_pipeline(a.out)
        print(json.dumps(result, indent=1))
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
