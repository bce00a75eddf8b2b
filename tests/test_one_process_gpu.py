"""One-GPU runs with the in-process engine (issue 26 item 1), proven on the CPU.

Two things broke `make demo` on one GPU: the in-process engine was built on the CPU while the trainer ran on CUDA
(fp32 rollouts, and a weight-sync transport the engine refuses), and Liger's patch rebinds RoPE / RMSNorm / MLP in
transformers' modeling module, so the engine's model, built earlier in the same process, ran Triton RoPE on its CPU
tensors. The first is shown with a recording stand-in for the engine and a mesh that says "cuda"; the second runs
as is on the CPU (Liger's patch is pure Python; its kernels are what a CPU tensor cannot run).
"""

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

import engines.local
from engines.registry import EngineSpec, build_engine
from trainer.backend.parallel import apply_liger
from trainer.backend.steps import mesh_device
from trainer.cli import engines_for, load_run_config

ROOT = Path(__file__).resolve().parents[1]
PATCHED_NAMES = ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")


@pytest.fixture
def qwen2_globals():
    """Put transformers' qwen2 module back whatever happens (a leaked patch would break later tests)."""
    saved = {k: getattr(modeling_qwen2, k) for k in PATCHED_NAMES}
    yield saved
    for k, v in saved.items():
        setattr(modeling_qwen2, k, v)


def _tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    return Qwen2ForCausalLM(cfg).eval()


def test_liger_patches_the_trainers_modules_only(qwen2_globals):
    pytest.importorskip("liger_kernel")
    engine_model = _tiny_qwen2(0)  # the in-process engine's model: built first, on the CPU
    ids = torch.arange(11)[None] % 97
    with torch.no_grad():
        before = engine_model(ids).logits
    trainer_model = _tiny_qwen2(1)
    assert apply_liger(trainer_model)
    # The process keeps transformers' code: the engine's forward still runs (Liger's Triton RoPE on CPU tensors
    # raised here before) and gives the same logits; a model built after the patch is a plain HF model.
    assert all(getattr(modeling_qwen2, k) is v for k, v in qwen2_globals.items())
    with torch.no_grad():
        torch.testing.assert_close(engine_model(ids).logits, before, rtol=0, atol=0)
    later = _tiny_qwen2(2)
    assert type(later.model.norm) is qwen2_globals["Qwen2RMSNorm"] and "forward" not in vars(later.model.norm)
    # The trainer's own modules carry Liger's kernels (bound on the instance).
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    assert trainer_model.model.norm.forward.__func__ is LigerRMSNorm.forward
    for layer in trainer_model.model.layers:
        assert layer.input_layernorm.forward.__func__ is LigerRMSNorm.forward
        assert layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert "forward" not in vars(engine_model.model.norm) and "forward" not in vars(engine_model.model.layers[0].mlp)


class _RecordedEngine:
    """Stands in for LocalEngine: records how it was built (a CUDA engine cannot be built here)."""

    built: list[dict] = []

    def __init__(self, model: str, **kwargs):
        self.built.append({"model": model, **kwargs})

    def close(self) -> None:
        pass


def test_the_in_process_engine_is_built_on_the_trainers_device(monkeypatch, tmp_path):
    monkeypatch.setattr(engines.local, "LocalEngine", _RecordedEngine)
    _RecordedEngine.built = []
    build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=3, device="cuda:0")
    assert _RecordedEngine.built[-1] == {"model": "tiny", "seed": 3, "device": "cuda:0", "threads": None,
                                         "borrow_cores": False}
    build_engine(EngineSpec(kind="local"), model_folder="tiny")  # CPU callers (tests, examples) are unchanged
    assert _RecordedEngine.built[-1]["device"] == "cpu"

    cfg = load_run_config(ROOT / "configs" / "demo.toml", [f"output_dir=\"{tmp_path}\""])
    assert any(s.kind == "local" for s in cfg.engines.fleet)
    with engines_for(cfg, Path("tiny"), is_main=True, device="cuda:0") as fleet:
        assert any(isinstance(t, dict) and isinstance(t.get("engine"), _RecordedEngine) for t in fleet)
    assert _RecordedEngine.built[-1]["device"] == "cuda:0"
    assert _RecordedEngine.built[-1]["threads"] == cfg.engines.threads == 1  # [engines] threads: its model thread


def test_the_cli_run_gives_the_engine_the_meshs_device(monkeypatch, tmp_path):
    """trainer.run.run on a (stand-in) CUDA mesh asks engines_for for an engine on that rank's GPU."""
    import trainer.backend.steps as steps
    import trainer.run as cli  # where run() and engines_for live

    class CudaMesh:
        device_type = "cuda"

        def get_rank(self) -> int:
            return 0

    seen = []

    class Stop(Exception):
        pass

    def recording_engines_for(cfg, model_folder, *, is_main, device="cpu"):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(steps, "init_distributed", lambda *a, **k: CudaMesh())
    monkeypatch.setattr(steps, "mesh_device", lambda t: torch.device("cuda", 0) if t == "cuda" else mesh_device(t))
    monkeypatch.setattr(cli, "engines_for", recording_engines_for)
    cfg = load_run_config(ROOT / "configs" / "demo.toml", [f"output_dir=\"{tmp_path}\""])
    with pytest.raises(Stop):
        cli.run("demo", cfg)
    assert seen == ["cuda:0"]
    assert mesh_device("cpu") == torch.device("cpu")


def test_liger_only_in_eager_blocks_on_cuda():
    """Liger's modules go into eager CUDA blocks only: inside inductor-compiled blocks the H100 run's SFT step hit an
    illegal memory access (bench/results/nvidia-h100.md), and inductor fuses the norms and SwiGLU itself."""
    from trainer.backend.parallel import ParallelConfig, uses_liger

    got = {(dev, liger, compiled): uses_liger(dev, ParallelConfig(compile=compiled, liger=liger))
           for dev in ("cuda", "cpu") for liger in (True, False) for compiled in (True, False)}
    assert [k for k, v in got.items() if v] == [("cuda", True, False)]
