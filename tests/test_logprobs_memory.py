"""Peak host memory of linear_token_logprobs vs the materialising reference (CPU, torch path).

Each variant runs forward+backward at T=2048, H=256, V=32000 fp32 in its own subprocess (peak RSS only grows
within a process); the fused op must add at most a quarter of what the reference adds over the inputs. The
full fp32 logits alone are 2048 * 32000 * 4 B = 262 MB; the fused op's chunks are a few MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from kernels import linear_token_logprobs
    from kernels.reference import linear_token_logprobs_ref

    def kb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    torch.manual_seed(0)
    T, H, V = 2048, 256, 32000
    hidden = torch.randn(T, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.05).requires_grad_(True)
    labels = torch.randint(0, V, (T,))
    g1, g2 = torch.randn(T), torch.randn(T)
    fn = linear_token_logprobs if sys.argv[1] == "fused" else linear_token_logprobs_ref
    try:  # reset the peak-RSS mark so set-up temporaries do not count (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = kb("VmRSS")
    logp, ent = fn(hidden, weight, labels, return_entropy=True)
    (logp * g1 + ent * g2).sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    print(json.dumps({"added_mb": (kb("VmHWM") - base) / 1024}))
    """
)


def _added_mb(variant: str) -> float:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}  # the production CPU path, not the interpreter
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, variant], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["added_mb"]


def test_linear_token_logprobs_adds_at_most_a_quarter_of_the_reference_memory():
    fused = _added_mb("fused")
    ref = _added_mb("reference")
    # The reference holds at least the fp32 logits and their log-softmax (2 x 524 MB).
    assert ref > 500, f"reference added only {ref:.0f} MB: the measurement is broken"
    assert fused <= ref / 4, f"fused added {fused:.0f} MB, reference {ref:.0f} MB (limit: a quarter)"
