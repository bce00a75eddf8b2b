"""The embedded engine's KV cache: preallocated buffers written in place (engines/embedded/generation.py uses it).

Per layer, keys and values buffers [rows_capacity, H, capacity, D]. Rows are left-padded so every running row
appends its next key/value at the same column `length`; attention reads the views [rows, H, length, D] of the
filled prefix. `KVCache` is a transformers `Cache` (one `_BufferLayer` per model layer, CacheLayerMixin: works
with transformers 5.17 and 5.24), so the model's own attention code writes and reads it; the decode loop moves
rows, appends joined ones and rebuilds it when it must grow (DecodeBatch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _BufferLayer(CacheLayerMixin):
    """One layer's keys and values: buffers [rows_capacity, H, capacity, D] whose rows [0, rows) and columns
    [0, length) are the batch's (`keys`, `values`: views of them, what attention reads). `update` writes the new
    columns after the filled ones, in place.

    Under torch.compile: `length` is a plain int (dynamo makes it a symbol, so one graph serves every length) and
    `update` reads no view of the buffers it writes (an input aliasing a mutated one makes AOT autograd build a
    synthetic base, which fails on symbolic storage sizes). is_compileable: also tells transformers' mask code not to
    read the 2D padding mask on the host to skip the causal mask at q_length 1 (masking_utils, 5.17 to 5.24), so a
    decode step's forward issues no host sync."""

    is_compileable = True
    is_sliding = False

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, rows: int, length: int):
        super().__init__()
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.device, self.dtype = key_buffer.device, key_buffer.dtype
        self.is_initialized = True
        self.view(rows, length)

    def view(self, rows: int, length: int) -> None:
        self.rows, self.length = rows, length
        self.keys = self.key_buffer[:rows, :, :length]
        self.values = self.value_buffer[:rows, :, :length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # built with its buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value states [rows, H, q, D] at columns [length, length + q)."""
        rows, n, q = key_states.shape[0], self.length, key_states.shape[2]
        if n + q > self.key_buffer.shape[2]:  # DecodeBatch reserves before its forwards; other callers grow here
            self.grow(max(n + q, 2 * self.key_buffer.shape[2]))
        self.key_buffer[:rows, :, n:n + q].copy_(key_states)
        self.value_buffer[:rows, :, n:n + q].copy_(value_states)
        self.view(rows, n + q)
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)
        self.view(self.rows, self.length)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset), as DynamicLayer

    def get_max_length(self) -> int:
        return -1  # grows


class KVCache(Cache):
    """The batch's preallocated KV cache (the module docstring gives the layout): a transformers `Cache` of one
    `_BufferLayer` per model layer, all with the same rows, length and capacities."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], rows: int, length: int):
        super().__init__(layers=[_BufferLayer(k, v, rows, length) for k, v in buffers])

    @staticmethod
    def allocate(like: list[tuple[torch.Tensor, torch.Tensor]], rows_capacity: int, capacity: int) -> KVCache:
        """An empty cache (0 rows, length 0) with zeroed buffers shaped like the per-layer (keys, values) `like`
        [*, H, *, D]. Zeros: a column a row does not attend to is masked, never NaN."""
        def zeros(t):
            return t.new_zeros(rows_capacity, t.shape[1], capacity, t.shape[3])
        return KVCache([(zeros(k), zeros(v)) for k, v in like], 0, 0)

    @property
    def rows(self) -> int:
        return self.layers[0].rows

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def rows_capacity(self) -> int:
        return self.layers[0].key_buffer.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].key_buffer.shape[2]

    def view(self, rows: int, length: int) -> None:
        for layer in self.layers:
            layer.view(rows, length)

    def rebuilt(self, rows_capacity: int, first: int, length: int, capacity: int,
                allocate: Callable[..., KVCache] | None = None) -> KVCache:
        """A new cache with the same rows, their columns [first, self.length) moved to end at column `length`
        (>= self.length - first), in new buffers [rows_capacity, H, capacity, D] (from `allocate(like,
        rows_capacity, capacity)`: KVCache.allocate, or a pool's that may round both up)."""
        width = self.length - first
        new = (allocate or KVCache.allocate)([(layer.keys, layer.values) for layer in self.layers], rows_capacity,
                                             capacity)
        for old, layer in zip(self.layers, new.layers):
            layer.key_buffer[:self.rows, :, length - width:length] = old.keys[:, :, first:]
            layer.value_buffer[:self.rows, :, length - width:length] = old.values[:, :, first:]
        new.view(self.rows, length)
        return new

    def append_rows(self, kv: list[tuple[torch.Tensor, torch.Tensor]], where: torch.Tensor | None, count: int) -> None:
        """Add `count` rows after the batch's, right-aligned at column `length`: per layer (keys, values)
        [u, H, l, D] (l <= length), row j taking kv row where[j] (None: row j). Needs rows + count <= rows_capacity.
        Columns left of a new row's l are old values, masked for it."""
        rows, length = self.rows, self.length
        for (k, v), layer in zip(kv, self.layers):
            if where is not None:
                k, v = k.index_select(0, where), v.index_select(0, where)
            layer.key_buffer[rows:rows + count, :, length - k.shape[2]:length] = k
            layer.value_buffer[rows:rows + count, :, length - v.shape[2]:length] = v
        self.view(rows + count, length)

    def align(self, shifts: list[int], length: int, span: int) -> None:
        """Shift row i's columns right by shifts[i] (>= 0), then view the columns [0, length): a speculative step
        (engines/embedded/generation.py, `_verify`) wrote the same number of columns for every row but keeps a
        different number of them, and this puts each row's kept columns back to end at `length`. Only the columns
        [length - span, length) are written (span: the most columns a row attends to); rows without a shift are not
        touched. One copy per distinct shift (a few: at most the draft length), of whole column ranges."""
        start = length - span
        for s in sorted(set(shifts) - {0}):
            rows = torch.tensor([i for i, x in enumerate(shifts) if x == s], dtype=torch.long,
                                device=self.layers[0].key_buffer.device)
            lo = max(start - s, 0)  # columns left of 0 hold nothing a row attends to
            for layer in self.layers:
                for buf in (layer.key_buffer, layer.value_buffer):
                    buf[:, :, lo + s:length].index_copy_(0, rows, buf[:, :, lo:length - s].index_select(0, rows))
        self.view(self.rows, length)

    def copy_rows(self, src: torch.Tensor) -> None:
        """Append copies of rows `src` (all columns of the filled length) after the batch's rows. Needs rows +
        len(src) <= rows_capacity."""
        rows, length, n = self.rows, self.length, src.shape[0]
        for layer in self.layers:
            for buf in (layer.key_buffer, layer.value_buffer):
                buf[rows:rows + n, :, :length] = buf[:, :, :length].index_select(0, src)
        self.view(rows + n, length)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Copy rows src into rows dst (all columns of the filled length), then keep the first `rows` rows."""
        length = self.length
        for layer in self.layers:
            for buf in (layer.key_buffer, layer.value_buffer):
                filled = buf[:, :, :length]
                filled.index_copy_(0, dst, filled.index_select(0, src))
        self.view(rows, length)
