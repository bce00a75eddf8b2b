"""The embedded engine's decode step as CUDA graphs, one per bucketed row count and cache buffers
([engines] cuda_graphs; issue 42 item 8).

A decode step of a small model on a GPU is launch-bound: a forward of one token a row is a few hundred kernels of a
few microseconds each, and the host issuing them (Python, transformers' modules, the compiled wrapper's guards) is
slower than the GPU running them. A CUDA graph records the step's kernels once and replays them in one launch. A
graph replays the same kernels on the same addresses with the same shapes, so the step it records is built to be
static:

- rows: the batch's P cache rows are padded to a bucket Bb (the next power of two). A pad row feeds the pad token at
  position 0 and attends to its own column only; its key/value lands in a cache row the batch does not use (a later
  join or fork writes that row before using it, and columns left of a row's first token are masked for it);
- columns: attention reads the buffers' whole capacity C, keys/values [Bb, Hkv, C, D], under a mask [Bb, 1, 1, C]
  built on the device from the write column `col` (a device scalar: the cache's filled length) and each row's first
  real column `col - pos`; the new key/value is written at `col` by `index_copy_`. One graph serves every length;
- addresses: the cache's buffers come from a pool (`BufferPool`, shapes rounded up to powers of two) that keeps them
  across batches, so the graph of (Bb, those buffers) is captured once and replayed by every later batch that gets
  them. Weight loads copy into the parameters in place (engines/weight_sync/receiver.py): graphs see new weights.

The step is the model's own forward (any architecture whose attention writes through the transformers Cache and
takes a 4D bool mask as given: sdpa, the engine's CPU attention; not eager attention, which adds a mask to its
scores, nor flash-attn's or flex's layouts), so its logits are the eager decode's up to the order of the softmax's
sums over the masked columns (they add exact zeros).
LoRA rows and speculative steps decode eagerly as before (engines/embedded/generation.py).

On the CPU `GraphDecode` runs the same static step without capturing it (no CUDA graphs there): how the tests prove
the step, the padding and the pool against the engine's ordinary decode. On CUDA a capture that fails leaves that
step eager, and MAX_CAPTURE_FAILURES of them turn graphs off for the engine with one warning (a speed fallback,
never a different answer). The graphs share one memory pool and write their logits into one buffer outside it
(`GraphDecode._output`), and the engine's attention reads each KV head once (engines/embedded/attention.py: where
transformers' sdpa would copy the whole capacity C per query head), so the pool holds about one step's activations
and logits; it is outside the KV budget (not yet measured on a GPU).
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engines.embedded.attention import ENGINE_SDPA
from engines.embedded.kv_cache import KVCache

MIN_CAPACITY = 16  # the pool's smallest column capacity
MAX_CAPTURE_FAILURES = 3  # captures that may fail (e.g. another thread's work in the way) before graphs are off
# Attention implementations that take the step's 4D bool mask as it is (eager attention adds a given mask to the
# scores, so a bool one would mask nothing; flash-attn's and flex's build their own layouts)
GRAPH_ATTENTION = ("sdpa", ENGINE_SDPA)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the static step would not compute `model`'s decode (None: it would): its attention must take the given
    mask, and every layer must attend to all of a row's columns (a sliding window would need its own mask)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in GRAPH_ATTENTION:
        return f"attention {impl!r} (graphs take {', '.join(GRAPH_ATTENTION)})"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return f"layer types {sorted(set(config.layer_types))} (a sliding window needs its own mask)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return f"sliding_window = {config.sliding_window}"
    return None


def bucket(n: int) -> int:
    """The row count a graph is captured for: the next power of two >= n (n >= 1)."""
    assert n >= 1, n
    return 1 << (n - 1).bit_length()


def pooled_shape(rows: int, columns: int) -> tuple[int, int]:
    """The (rows, columns) of the buffers the pool gives for a cache of at least `rows` x `columns`."""
    return bucket(rows), max(bucket(columns), MIN_CAPACITY)


class BufferPool:
    """KV-cache buffers kept across batches, by shape (rows and columns rounded up to powers of two: `pooled_shape`),
    so the same addresses come back and their graphs replay. `allocate` hands out zeroed buffers (the semantics of a
    new cache: a column no row attends to holds zeros, never a NaN an earlier batch left); `give` takes a cache's
    buffers back, keeping at most `max_idle_cells` KV cells idle (None: no limit; past it the oldest sets go, with
    `on_drop(their first key buffer)`: the graphs over them are dropped too, so the memory is freed). Mutable (the
    idle sets): a class."""

    def __init__(self, max_idle_cells: int | None = None, on_drop=lambda buffer: None) -> None:
        self.idle: list[tuple[tuple, list]] = []  # (key, buffer set) of every idle set, oldest first
        self.max_idle_cells, self.on_drop = max_idle_cells, on_drop
        self.allocated = 0  # buffer sets created (a test reads it: reuse means no new ones)

    @staticmethod
    def _key(like: list[tuple[torch.Tensor, torch.Tensor]], rows: int, capacity: int) -> tuple:
        return (rows, capacity, like[0][0].dtype, like[0][0].device,
                tuple((k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in like))

    def allocate(self, like: list[tuple[torch.Tensor, torch.Tensor]], rows_capacity: int, capacity: int) -> KVCache:
        """An empty KVCache like `KVCache.allocate`'s, with at least `rows_capacity` rows and `capacity` columns."""
        rows, cols = pooled_shape(rows_capacity, capacity)
        key = self._key(like, rows, cols)
        # The oldest set of that shape: a batch like the last one gets its buffers in the same order
        i = next((i for i, (k, _) in enumerate(self.idle) if k == key), None)
        if i is not None:
            _, buffers = self.idle.pop(i)
            for k, v in buffers:
                k.zero_()
                v.zero_()
            return KVCache(buffers, 0, 0)
        self.allocated += 1
        return KVCache.allocate(like, rows, cols)

    def give(self, cache: KVCache | None) -> None:
        """Take back the buffers of a cache the batch no longer uses."""
        if cache is None:
            return
        buffers = [(layer.key_buffer, layer.value_buffer) for layer in cache.layers]
        self.idle.append((self._key(buffers, cache.rows_capacity, cache.capacity), buffers))
        while self.max_idle_cells is not None and self.idle_cells > self.max_idle_cells:
            _, old = self.idle.pop(0)
            self.on_drop(old[0][0])

    @property
    def idle_cells(self) -> int:
        """KV cells (rows x columns) of the idle buffer sets."""
        return sum(key[0] * key[1] for key, _ in self.idle)


class _StaticLayer(CacheLayerMixin):
    """One layer of the static step's cache: its buffers' first Bb rows at full capacity; `update` writes the new
    key/value [Bb, Hkv, 1, D] at column `col` (a device tensor [1]) and returns the whole [Bb, Hkv, C, D]."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, col: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.col, self.length = keys, values, col, length
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        assert key_states.shape[2] == 1, key_states.shape  # a decode step: one token a row
        self.keys.index_copy_(2, self.col, key_states)
        self.values.index_copy_(2, self.col, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length  # read by the forward for cache positions; the step's mask is given, its rope positions too

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


@dataclass
class _Step:
    """One graph's static tensors: inputs ids, pos [Bb, 1] and col [1] (written before each replay), the cache
    layers over the pooled buffers, the output logits [Bb, V] fp32 (rows of the engine's one output buffer:
    `GraphDecode._output`), and the graph (None on the CPU)."""

    ids: torch.Tensor
    pos: torch.Tensor
    col: torch.Tensor
    cache: Cache
    logits: torch.Tensor | None = None
    graph: object | None = None


class GraphDecode:
    """The decode step by graphs: `decode(cache, last, pos)` -> logits [P, V] fp32 for the cache's P rows, each fed
    its token `last` [P] at position `pos` [P]; the cache's view moves one column on, as the eager step's does.
    Graphs are keyed by (Bb, the cache's buffers); at most `max_graphs` are kept (the least recently replayed go
    first: a workload whose shapes keep changing captures again, never grows memory without bound), and the pool
    keeps at most `max_idle_cells` KV cells of buffers between batches (None: no limit). A capture that fails
    leaves that step eager; MAX_CAPTURE_FAILURES of them turn graphs off for the engine, with a warning.
    A capture costs a device synchronize and an empty_cache (torch.cuda.graph's entry): once per graph.
    Mutable (the graphs): a class."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int, max_graphs: int = 64,
                 max_idle_cells: int | None = None):
        self.model, self.pad_id, self.max_graphs = model, pad_id, max_graphs
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda"
        self.pool = BufferPool(max_idle_cells, on_drop=self._drop)
        self.steps: collections.OrderedDict[tuple, _Step] = collections.OrderedDict()  # least recently used first
        self.captures = 0  # graphs captured (CUDA) or static steps built (CPU)
        self.failures = 0  # captures that failed
        self.failed: str | None = None  # why capturing failed (CUDA) when graphs are off for this engine
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self._logits: torch.Tensor | None = None  # [R, V] fp32, R the largest bucket captured: every graph's output

    def _drop(self, buffer: torch.Tensor) -> None:
        """The pool let `buffer`'s set go: the graphs over it go too (they hold its memory)."""
        ptr = buffer.data_ptr()
        for key in [k for k in self.steps if k[1] == ptr]:
            del self.steps[key]

    def usable(self, cache: KVCache) -> bool:
        """Whether this step can run as a graph: capture has not failed, and the cache's buffers are the pool's."""
        return self.failed is None and cache.rows_capacity == bucket(cache.rows_capacity)

    @staticmethod
    def _key(cache: KVCache, rows: int) -> tuple:
        """A step's key: its row bucket and its buffers (their address and columns)."""
        return rows, cache.layers[0].key_buffer.data_ptr(), cache.capacity

    def _step(self, key: tuple, cache: KVCache, rows: int) -> _Step:
        """The static step of `key` (built now if it is not kept), as the most recently used."""
        step = self.steps.get(key)
        if step is not None:
            self.steps.move_to_end(key)
        else:
            while len(self.steps) >= self.max_graphs:
                self.steps.popitem(last=False)
            long = dict(dtype=torch.long, device=self.device)
            col = torch.zeros((1,), **long)
            layers = [_StaticLayer(layer.key_buffer[:rows], layer.value_buffer[:rows], col, 0)
                      for layer in cache.layers]
            static = Cache(layers=layers)
            step = _Step(torch.full((rows, 1), self.pad_id, **long), torch.zeros((rows, 1), **long), col, static)
            self.steps[key] = step
        return step

    def _forward(self, step: _Step) -> torch.Tensor:
        """The static step: logits [Bb, V] in the model's dtype. Row i attends to columns [col - pos_i, col] of its
        cache row."""
        columns = torch.arange(step.cache.layers[0].keys.shape[2], device=self.device)  # [C]
        start = step.col - step.pos  # [Bb, 1]: a pad row (pos 0) starts at col: its own column only
        mask = (columns[None, :] >= start) & (columns[None, :] <= step.col)  # [Bb, C]
        out = self.model(input_ids=step.ids, attention_mask=mask[:, None, None, :], position_ids=step.pos,
                         past_key_values=step.cache, use_cache=True)
        return out.logits[:, -1]

    def _output(self, rows: int, vocab: int) -> torch.Tensor:
        """[rows, V] fp32 rows of the output buffer every graph writes its logits into. It lives outside the graphs'
        memory pool, so a graph's pool keeps only its step's temporaries, which the next capture reuses (one shared
        pool): the pool holds the largest step's, not every graph's logits (a graph per row bucket and cache
        buffers, ~Bb x V x 4 bytes each: 155 MB at 256 rows of a 152k vocabulary). A larger bucket gets a new buffer
        (the graphs over the old one keep it): at most twice the largest. One decode at a time reads it, before the
        next replay, as it read each graph's own logits before."""
        if self._logits is None or self._logits.shape[0] < rows or self._logits.shape[1] != vocab:
            self._logits = torch.empty((rows, vocab), dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    def _capture(self, step: _Step) -> None:
        """Record `step` as a CUDA graph: two eager runs on a side stream first (lazy initialisation: cuBLAS
        workspaces, kernels' first launches), then the capture; each run writes the same key/value at the same
        column, so running the step again is harmless."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                vocab = self._forward(step).shape[1]
        torch.cuda.current_stream().wait_stream(side)
        logits = self._output(step.ids.shape[0], vocab)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's thread may run CUDA work meanwhile (async RL, an in-process engine); the
        # default ("global") would make its allocations fail the capture
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits.copy_(self._forward(step))  # the cast to fp32 and the write to the buffer: one kernel
        step.logits, step.graph = logits, graph

    def decode(self, cache: KVCache, last: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """Logits [P, V] fp32 of the step, or None when graphs are off (capture failed): decode eagerly then."""
        p, length = cache.rows, cache.length
        assert last.shape == pos.shape == (p,) and length + 1 <= cache.capacity, (last.shape, length, cache.capacity)
        rows = bucket(p)
        assert rows <= cache.rows_capacity, (rows, cache.rows_capacity)
        key = self._key(cache, rows)
        fresh = key not in self.steps
        step = self._step(key, cache, rows)
        step.ids[:p, 0].copy_(last)
        step.ids[p:].fill_(self.pad_id)
        step.pos[:p, 0].copy_(pos)
        step.pos[p:].zero_()
        step.col.fill_(length)
        for layer in step.cache.layers:
            layer.length = length
        if not self.capture:
            self.captures += fresh
            logits = self._forward(step).float()
        else:
            if step.graph is None:
                try:
                    self._capture(step)
                except Exception as e:  # noqa: BLE001 - a step that cannot be captured decodes eagerly
                    self.failures += 1
                    del self.steps[key]
                    if self.failures >= MAX_CAPTURE_FAILURES:
                        self.failed = f"{type(e).__name__}: {e}"
                        self.steps.clear()
                        warnings.warn(f"[engines] cuda_graphs: capturing the decode step failed {self.failures} "
                                      f"times (last: {self.failed}); this engine decodes without graphs from now on",
                                      RuntimeWarning, stacklevel=2)
                    return None
                self.captures += 1
            step.graph.replay()
            logits = step.logits
        cache.view(p, length + 1)
        return logits[:p]
