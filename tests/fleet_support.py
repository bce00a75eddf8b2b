"""A one-step RL run through the CLI on demo.toml with its [engines] table replaced (test_fleets.py, and the real
vLLM's fleet test in test_engine_vllm_real.py, which shares that module's server)."""

import subprocess
import sys
from pathlib import Path

from device_support import cpu_child_env

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def run_one_rl_step(cfg) -> subprocess.CompletedProcess:
    """`python -m trainer rl` for one verified-sync step of 4 prompts on the run config `cfg`; must exit 0."""
    cmd = [sys.executable, "-m", "trainer", "rl", "--config", str(cfg), "--set", "rl.num_steps=1",
           "--set", "rl.rollout.rollout_batch_size=4", "--set", "rl.rollout.dynamic_filters=[]",
           "--set", "eval.limit=4", "--set", "rl.verify_sync=true"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def config_with_engines(tmp_path: Path, engines_toml: str, name: str = "fleet") -> Path:
    """demo.toml with its [engines] table replaced, data paths made absolute, output under tmp_path."""
    text = DEMO.read_text()
    start = text.index("[engines]")
    end = text.index("\n[", start + 1)
    text = text[:start] + "[engines]\n" + engines_toml.strip() + "\n" + text[end:]
    text = text.replace('"data/', f'"{ROOT}/data/').replace('output_dir = "runs/demo"',
                                                            f'output_dir = "{tmp_path / name}"')
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path
