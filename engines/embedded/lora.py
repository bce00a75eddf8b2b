"""Several LoRA adapters in one embedded engine: a per-row adapter gather at each adapted nn.Linear.

The base weights are never modified. Each adapted module gets a forward hook that adds, for row n of the forward,

    scaling[s] * (x[n] @ A[s].T) @ B[s].T      s = the slot of row n's adapter (slot 0: the base, all zeros)

from stacked tensors A [S, r, in] and B [S, out, r] (scaling folded into B; adapters of smaller rank padded with
zero rows of A / columns of B, which add exactly nothing). So one decode batch mixes rows of any adapters and base
rows, as multi-LoRA servers (S-LoRA, Punica, SGLang, vLLM) do, here with two batched matmuls (bmm) per module.
The batch (engines/embedded/generation.py DecodeBatch) tells the set which slot each row of the next forward uses
(`rows`); with no adapter row in a forward the hooks add nothing and cost one attribute read.

Slots and names: a name maps to a slot; loading an existing name writes its slot in place (rows of it running go on
with the new weights from the next step, like an in-place weight update); unloading drops the name at once, and its
slot is reused only once no row holds it (the server passes the slots its rows hold). All writes run on the engine's
model thread, between decode steps.

Adapter tensors: PEFT's saved keys of a base nn.Linear of the model, "<module path>.lora_A.weight" [r, in] and
"<module path>.lora_B.weight" [out, r]; a leading "base_model.model." (adapter_model.safetensors) and PEFT's
in-model adapter name (".lora_A.default.weight") are accepted too.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection

import torch
from torch import nn

# "<path>.lora_A.weight", "<path>.lora_B.default.weight": (path, "A" | "B")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class AdapterSet:
    """The named adapters of one engine model (mutable; see the module docstring). Not thread-safe: `write` runs on
    the model thread, the name bookkeeping on the server's event loop."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.names: dict[str, int] = {}  # adapter name -> slot (>= 1)
        self.default: str | None = None  # the adapter of requests that name none (a LoRA run's synced policy)
        self.capacity = 0  # adapter slots allocated (1 .. capacity); slot 0 is the base
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module path -> (A [S, r, in], B [S, out, r])
        self.hooks: dict[str, object] = {}
        self.rows: torch.Tensor | None = None  # [N] long: the slot of each row of the next forward; None: all base

    def __len__(self) -> int:
        return len(self.names)

    def slot(self, name: str | None) -> int:
        """The slot of a request's adapter (None: the default adapter if one is set, else the base = 0)."""
        if name is None:
            return self.names[self.default] if self.default is not None else 0
        if name not in self.names:
            raise KeyError(f"adapter {name!r} is not loaded in this engine; loaded: {sorted(self.names)} (load it "
                           f"first: /load_lora_adapter or load_adapter)")
        return self.names[name]

    def free_slot(self, name: str, in_use: Collection[int]) -> int:
        """The slot `name` is (re)written into: its own if loaded, else the first slot neither named nor held by a
        row (`in_use`), else a new one."""
        if name in self.names:
            return self.names[name]
        taken = set(self.names.values()) | set(in_use)
        return next(s for s in range(1, self.capacity + 2) if s not in taken)

    def parse(self, tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{module path: (A [r, in], B [out, r] * scaling)} in the engine's dtype and device, checked against the
        model (ValueError naming the bad key and the fix; nothing is written)."""
        if not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise ValueError(f"scaling={scaling!r}: give lora_alpha / r (a finite number)")
        if not tensors:
            raise ValueError("the adapter has no tensors: give PEFT's '<module>.lora_A.weight' / "
                             "'<module>.lora_B.weight' pairs")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(f"adapter tensor {key!r} is not a LoRA weight: expected PEFT's keys like "
                                 f"'model.layers.0.self_attn.q_proj.lora_A.weight'")
            parts.setdefault(m["path"], {})[m["ab"]] = t
        out = {}
        for path, ab in parts.items():
            lin = self.linears.get(path)
            if lin is None:
                raise ValueError(f"adapter module {path!r} is not an nn.Linear of this engine's model (it has e.g. "
                                 f"{next(iter(self.linears), None)!r}); the adapter was trained for another model")
            if set(ab) != {"A", "B"}:
                raise ValueError(f"adapter module {path!r} has lora_{''.join(ab)} only: give both lora_A and lora_B")
            a, b = ab["A"], ab["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != lin.in_features or b.shape[0] != lin.out_features \
                    or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter module {path!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                                 f"not fit the Linear ({lin.in_features} -> {lin.out_features}): need A [r, "
                                 f"{lin.in_features}], B [{lin.out_features}, r]")
            out[path] = (a.detach().to(self.device, self.dtype),
                         (b.detach().to(self.device, torch.float32) * scaling).to(self.dtype))
        return out

    @torch.no_grad()
    def write(self, slot: int, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """On the model thread: slot `slot` holds `modules` (every other adapted module of the slot zeroed)."""
        self._grow(slot, max(a.shape[0] for a, _ in modules.values()), modules)
        for path, (a_all, b_all) in self.stacks.items():
            a_all[slot].zero_()
            b_all[slot].zero_()
            if path in modules:
                a, b = modules[path]
                a_all[slot, : a.shape[0]].copy_(a)
                b_all[slot, :, : b.shape[1]].copy_(b)

    def _grow(self, slot: int, rank: int, modules: dict) -> None:
        """Stacks with room for slot `slot` and rank `rank` (zero padded), for every module adapted so far or by
        `modules`; hooks on the newly adapted ones."""
        self.capacity = max(self.capacity, slot)
        for path in list(self.stacks) + [p for p in modules if p not in self.stacks]:
            lin = self.linears[path]
            a_old, b_old = self.stacks.get(path, (None, None))
            s_old, r_old = (a_old.shape[0], a_old.shape[1]) if a_old is not None else (0, 0)
            s, r = max(s_old, self.capacity + 1), max(r_old, rank)
            if (s, r) == (s_old, r_old):
                continue
            a = torch.zeros((s, r, lin.in_features), dtype=self.dtype, device=self.device)
            b = torch.zeros((s, lin.out_features, r), dtype=self.dtype, device=self.device)
            if a_old is not None:
                a[:s_old, :r_old].copy_(a_old)
                b[:s_old, :, :r_old].copy_(b_old)
            self.stacks[path] = (a, b)
            if path not in self.hooks:
                self.hooks[path] = lin.register_forward_hook(self._hook(path))

    def _hook(self, path: str):
        def add_adapters(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            idx = self.rows
            if idx is None:
                return None
            x = inputs[0]  # [N, T, in]: one row per batch row (decode T = 1, prefill T = the padded prompt)
            assert x.dim() == 3 and x.shape[0] == idx.shape[0], f"{path}: input {tuple(x.shape)}, {idx.shape[0]} rows"
            a, b = self.stacks[path]
            # [N, T, in] @ [N, in, r] -> [N, T, r] @ [N, r, out] -> [N, T, out]; base rows gather zeros
            low = torch.bmm(x, a.index_select(0, idx).transpose(1, 2))
            return output + torch.bmm(low, b.index_select(0, idx).transpose(1, 2))

        return add_adapters


def read_peft_folder(path: str) -> tuple[dict[str, torch.Tensor], float]:
    """(tensors, scaling) of a PEFT adapter folder (adapter_config.json + adapter_model.safetensors): scaling is
    lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). A folder with per-module ranks or alphas is refused."""
    from safetensors.torch import load_file

    config_path, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights)):
        raise ValueError(f"lora_path {path!r} is not a PEFT adapter folder this engine can read (it needs "
                         f"adapter_config.json and adapter_model.safetensors)")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{config_path}: rank_pattern / alpha_pattern (per-module ranks) are not supported: save "
                         f"the adapter with one r and lora_alpha")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return load_file(weights), scaling
