"""What the sender, the disk fallback and the verification share: the parameters in their fixed order and their
full values, the trainer's rank and its agreement helpers, and concurrent calls to every engine."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from engines.protocol import WeightSyncEndpoint
from engines.weight_sync.wire import WeightSyncError


def _engine_weights(model: nn.Module) -> list[tuple[str, torch.Tensor, nn.Module | None]]:
    """(HF name, parameter, its LoRA layer or None) of every weight an engine holds (trainer.backend.lora)."""
    from trainer.backend.lora import sync_weights
    from trainer.backend.models import is_value_head

    return [(n, p, layer) for n, p, layer in sync_weights(model) if not is_value_head(n)]


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in a fixed order; FSDP2 keeps the HF names; torch.compile's `_orig_mod.` is stripped.
    Tied weights appear once (named_parameters de-duplicates), as HF's load_state_dict expects. A value head (PPO
    with [rl.critic] kind = "head": trainer.backend.models) is the trainer's only: the engines never see it. A LoRA
    model's adapters are left out and its adapted weights go by their plain names (".base_layer." dropped): the
    engines get the merged weights (`gathered_weights`), a stock model's names and shapes."""
    return [(n, p) for n, p, _ in _engine_weights(model)]


def gathered_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) for every `named_weights` entry, in its order: a collective per weight (every
    rank iterates it to the end). An adapted weight is merged, W + (alpha / r) B @ A (trainer.backend.lora)."""
    from trainer.backend.lora import merged_weight

    with torch.no_grad():
        for name, p, layer in _engine_weights(model):
            yield name, merged_weight(p, layer, dtype)


def adapter_sync_weights(model: nn.Module, *, with_base: bool) -> list[tuple[str, torch.Tensor]]:
    """(wire name, parameter) of a LoRA model's adapter-only sync, in a fixed order: the engine-held weights the
    run trains outside the adapters (the lm_head with train_unembed; every base weight, unmerged, when `with_base`:
    the first sync after init_group, so a restarted engine gets the base), then each adapted module's A [r, in] and
    B [out, r] under PEFT's saved names ("<module>.lora_A.weight", engines.weight_sync.wire.is_lora_name)."""
    from trainer.backend.lora import ADAPTER, lora_layers

    out = [(n, p) for n, p, _ in _engine_weights(model) if with_base or p.requires_grad]
    for path, layer in lora_layers(model).items():
        path = path.replace("_orig_mod.", "")
        out += [(f"{path}.lora_A.weight", layer.lora_A[ADAPTER].weight),
                (f"{path}.lora_B.weight", layer.lora_B[ADAPTER].weight)]
    return out


def lora_scaling(model: nn.Module) -> float:
    """The one alpha / r of a LoRA model's adapters (what the engine scales B @ A by)."""
    from trainer.backend.lora import ADAPTER, lora_layers

    scales = {float(layer.scaling[ADAPTER]) for layer in lora_layers(model).values()}
    assert len(scales) == 1, f"adapters with different scalings {sorted(scales)}: one [lora] rank and alpha expected"
    return scales.pop()


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The unsharded value: a collective for FSDP2 DTensors (every rank must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def trainer_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every trainer rank when `flag` is True on any (one tiny all-reduce; no-op on one process)."""
    if not is_distributed():
        return flag
    t = torch.full((1,), int(flag), dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())  # host sync: every rank needs the sync's outcome before it goes on


def from_rank0(value):
    """Rank 0's `value` on every trainer rank (the trainer's own group; no-op on one process)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class EngineCalls:
    """Runs `make_call(i, engine)` for every engine concurrently (trio + httpx) in a helper thread; records the
    first error, naming the engine."""

    def __init__(self, engines: Sequence[WeightSyncEndpoint], make_call: Callable, what: str):
        self.error: BaseException | None = None
        self.results: list = [None] * len(engines)
        self._thread = threading.Thread(target=self._run, args=(list(engines), make_call, what), daemon=True)
        self._thread.start()

    def _run(self, engines, make_call, what):
        import trio

        async def one(i, eng):
            try:
                self.results[i] = await make_call(i, eng)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting trainer thread
                if self.error is None:
                    self.error = WeightSyncError(f"engine {eng.url} failed {what}: "
                                                 f"{type(e).__name__}: {e}")

        async def main():
            async with trio.open_nursery() as nursery:
                for i, eng in enumerate(engines):
                    nursery.start_soon(one, i, eng)

        trio.run(main)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def join(self, timeout_s: float, what: str) -> list:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightSyncError(f"{what}: no HTTP answer from every engine within {timeout_s:.0f}s")
        self.check()
        return self.results
