"""The engine's compiled decode step (the CUDA default): torch.compile over the model's forward, traced once.

A decode step's row count changes every few steps as rows join and finish, so the step is compiled with dynamic
shapes. Left to that alone, dynamo compiled the demo's decode three times, each an inductor compile (seconds on a
cold CUDA machine, before the first token):
- duck sizing: at the first call, sizes that happen to be equal share one symbol (the cache's rows and the batch's;
  the rows and the KV heads), so a later batch where they differ recompiles, or a dimension is traced as a constant
  because its twin was (the heads are);
- 0/1 specialisation: a graph traced at >= 2 rows guards `2 <= rows`, so a batch's last row alone recompiles.

So each call marks its inputs' row dimension unbacked (never specialised to 0 or 1, never duck-sized with another),
and runs with duck sizing off, which is read only while dynamo traces. One graph then serves every row count, cache
capacity and length (tests/test_decode_batch.py counts them on the CPU).

Should a compiler reject the unbacked rows (not seen on the CPU's inductor or aot_eager; not yet run on CUDA), the
engine warns and decodes through a plain dynamic-shape compile, as before: more compiles, the same tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.decorators import mark_unbacked
from torch._dynamo.exc import TorchDynamoException

# The decode call's tensors with a row dimension (first): the fed tokens [B, 1], the mask [B, L + 1], positions [B, 1]
_ROW_INPUTS = ("input_ids", "attention_mask", "position_ids")


def compiled_decode(model: torch.nn.Module, backend: str | Callable = "inductor") -> Callable:
    """A function with the decode call's signature (keyword arguments, as DecodeBatch calls it) running
    torch.compile(model.forward, dynamic=True, backend=backend) with the rows unbacked (module docstring)."""
    compiled = torch.compile(model.forward, dynamic=True, backend=backend)
    fallback: list[Callable] = []  # the plain compile, once the unbacked one failed

    def decode(**kwargs):
        if fallback:
            return fallback[0](**kwargs)
        marked = dict(kwargs)
        for name in _ROW_INPUTS:
            t = kwargs.get(name)
            if isinstance(t, torch.Tensor):
                marked[name] = t.view_as(t)  # the mark is the tensor object's: the caller's stay unmarked
                mark_unbacked(marked[name], 0)
        try:
            with fx_config.patch(use_duck_shape=False):
                return compiled(**marked)
        except TorchDynamoException as e:
            why = " ".join(str(e).split())[:300]
            warnings.warn(f"the engine's compiled decode could not trace its rows as unbacked ({why}); it compiles "
                          "again where the row count specialises instead (more compiles, the same tokens)",
                          RuntimeWarning, stacklevel=2)
            fallback.append(torch.compile(model.forward, dynamic=True, backend=backend))
            return fallback[0](**kwargs)

    return decode
