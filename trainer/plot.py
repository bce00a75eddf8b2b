"""A PNG of a run's curves (reward, loss, KL, entropy, ...) from its metrics.jsonl, written at the end of a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

# (metric key, panel title); the panels that have data are drawn, in this order.
PANELS = (
    ("reward_mean", "reward"),
    ("loss", "loss"),
    ("approx_kl", "KL (old vs new, k3)"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("clip_frac_high", "clip fraction (high)"),
    ("grad_norm", "grad norm"),
    ("response_length_mean", "response length"),
    ("critic/value_loss", "value loss (critic)"),  # PPO with a value model ([rl] advantage_estimator = "gae")
    ("critic/explained_variance", "explained variance (critic)"),
)


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *, title: str = "") -> Path | None:
    """Draw every known metric present in the JSONL; returns the PNG path (None when there is nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    path = Path(metrics_path)
    if not path.is_file():
        return None
    rows = read_metrics(path)
    series = []
    # Evaluation during training: each set's greedy accuracy (rows of the steps that evaluated, step 0 included).
    evals = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")})
    panels = [(k, f"held-out accuracy ({k.split('/')[1]})") for k in evals] + list(PANELS)
    for key, label in panels:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if pts and (key in evals or any(v != 0 for _, v in pts)):  # an all-zero curve (clip fraction) says nothing
            series.append((label, pts))
    if not series:
        return None
    cols = min(4, len(series))
    nrows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.8 * nrows), squeeze=False)
    for ax, (label, pts) in zip(axes.flat, series):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, axes, len(series), title, png_path)


def _save(fig, axes, used: int, title: str, png_path: str | Path) -> Path:
    """The unused panels blanked, the title set, the figure written to png_path (and closed)."""
    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

