"""Fixtures' helpers for the real-vLLM tests: a tiny Qwen2 folder written by transformers, and a vLLM server started
from `.venv-vllm` (built by `make .venv-vllm`, a dependency of `make test`).

The model is the smallest that vLLM 0.32's CPU attention serves: head_dim 64 (it rejects 16), so hidden 256 with
4 heads; two layers and the project's character tokenizer (~100 ids) keep start-up and forwards cheap.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from engines.vllm import vllm_server_command

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
START_TIMEOUT_S = 600.0


def build_tokenizer():
    """The project tokenizer, wherever it lives now (engines/tiny.py is its new home)."""
    try:
        from engines.tiny import build_tokenizer as build
    except ImportError:
        from trainer.tokenizer import build_tokenizer as build
    return build()


def require_vllm_venv() -> Path:
    """The venv's python; a FAIL (not a skip) when it is missing: `make test` builds it first."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make .venv-vllm` (the `test` target does) to install vLLM "
                    f"and this project's vLLM plugin into their own venv")
    # Cheap (no vLLM import): vLLM, this checkout's packages and the plugin's entry point are installed there
    check = ("import importlib.util as u, importlib.metadata as m, sys\n"
             "assert u.find_spec('vllm'), 'vllm is not installed'\n"
             "spec = u.find_spec('engines.vllm_ext')\n"
             "assert spec and spec.origin.startswith(sys.argv[1]), f'engines.vllm_ext is {spec and spec.origin}'\n"
             "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')]\n"
             "assert 'engines.vllm_ext:register' in eps, f'plugin entry point missing: {eps}'\n")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", check, str(ROOT)], cwd="/", capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        pytest.fail(f"{VLLM_VENV} lacks vLLM or this checkout's vLLM plugin; rebuild it with "
                    f"`rm -rf .venv-vllm && make .venv-vllm`:\n{probe.stderr[-2000:]}")
    return VLLM_PYTHON


def tiny_qwen2_config():
    """The project's tiny Qwen2 preset at the smallest size vLLM's CPU attention serves (head_dim 64)."""
    try:
        from engines.tiny import tiny_model_config
    except ImportError:
        from trainer.backend.models import tiny_model_config
    return tiny_model_config("qwen2", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)


def tiny_qwen2(seed: int):
    """A float32 Qwen2ForCausalLM with random weights from `tiny_qwen2_config()`, and the project tokenizer."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config()).float().eval()
    with torch.no_grad():  # HF's init (std 0.02) gives near-uniform outputs; wider weights give peaked, varied ones
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model, build_tokenizer()


def write_model_folder(path: Path, seed: int) -> tuple[torch.nn.Module, object]:
    model, tok = tiny_qwen2(seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok


def start_server(model_dir: Path, port: int, log_path: Path, extra: tuple[str, ...] = ("--enforce-eager",),
                 env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Start vLLM (dev mode routes, our weight-transfer back end, processed log-probs) and wait for /health.
    --enforce-eager by default: torch.compile of even this tiny model doubles start-up on two cores. env_extra:
    more environment variables (VLLM_ALLOW_RUNTIME_LORA_UPDATING for the adapter routes)."""
    python = require_vllm_venv()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO",
               VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    env.pop("TRITON_INTERPRET", None)  # the test session's Triton interpreter flag must not reach vLLM
    cmd = vllm_server_command(str(python), str(model_dir), port=port, extra=extra)
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process by stop_server
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    proc.log_file = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with code {proc.returncode} during start-up:\n{tail(log_path)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    pytest.fail(f"vLLM did not answer /health within {START_TIMEOUT_S:.0f}s:\n{tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    proc.log_file.close()


def tail(path: Path, n: int = 6000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError as e:
        return f"(no log: {e})"


__all__ = ["ROOT", "VLLM_PYTHON", "build_tokenizer", "require_vllm_venv", "start_server", "stop_server", "tail",
           "tiny_qwen2", "tiny_qwen2_config", "write_model_folder"]

