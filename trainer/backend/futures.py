"""TrainFuture: the result of queued training work (the Tinker shape).

`forward_backward` and `optim_step` return at once. On CUDA their kernels are queued on a compute stream and
their metrics stay on the device as tensors; a CUDA event recorded after the last kernel says when they are
ready. `.result()` waits on that event (the only host sync of a step) and converts the tensors to floats.
From trio, `await fut` polls `event.query()` with `trio.sleep`, so the event loop keeps serving rollouts while
the GPU works. On CPU the work has already run when the future is made: `.result()` just converts.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any, Generic, TypeVar

import torch

from kernels.device import shared_stream

T = TypeVar("T")

_POLL_S = 0.002  # trio polling period while a CUDA event is pending


def _to_host(value: Any) -> Any:
    """Device scalars -> Python floats, recursively (dicts, lists, tuples); other values unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.cpu()  # host sync (marked): the future is being read
    if isinstance(value, Mapping):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class TrainFuture(Generic[T]):
    """A value computed by queued device work. Mutable state: the cached host result once read."""

    def __init__(self, value: Any, event: torch.cuda.Event | None = None,
                 finalize: Callable[[Any], T] | None = None) -> None:
        self._value = value
        self._event = event
        self._finalize = finalize
        self._result: T | None = None
        self._read = False

    @classmethod
    def record(cls, value: Any, device: torch.device, finalize: Callable[[Any], T] | None = None,
               **fields: Any) -> TrainFuture[T]:
        """A future for `value` whose device work is everything queued so far on the current stream of `device`.

        fields: a subclass's own constructor arguments (e.g. trainer.backend.steps.GradFuture's num_tokens)."""
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return cls(value, event, finalize, **fields)

    def done(self) -> bool:
        """True once the device work finished (never blocks)."""
        return self._event is None or self._event.query()

    def result(self) -> T:
        """Block until the device work finished and return the value with device scalars as Python floats."""
        if not self._read:
            if self._event is not None:
                self._event.synchronize()
            host = _to_host(self._value)
            self._result = self._finalize(host) if self._finalize is not None else host
            self._value = None  # free device memory held by the metrics
            self._read = True
        return self._result  # type: ignore[return-value]

    async def aresult(self) -> T:
        """`result()` for trio: polls the event with trio.sleep instead of blocking the event loop."""
        import trio

        while not self.done():
            await trio.sleep(_POLL_S)
        return self.result()

    def __await__(self) -> Generator[Any, None, T]:
        return self.aresult().__await__()


class DeviceStreams:
    """The CUDA streams of a run on one device and the event hand-offs between them.

    compute: forward, backward and optimizer kernels; copy: host-to-device copies of the next micro-batch.
    Work moves between streams only through `record` (an event on the producer) and `wait` (the consumer waits
    on it on the device), so the host never blocks. Mutable state: the streams. A test can pass a stand-in
    with the same methods to observe the hand-offs on a machine without CUDA.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The process's shared compute stream: an in-process engine generating while the trainer waits queues its
        # work on it too (one pool of cached blocks for both: kernels.device.shared_stream)
        self.compute = shared_stream(device)
        self.copy = torch.cuda.Stream(device)

    def current(self) -> Any:
        """The stream the caller queues work on (the default stream unless it chose another)."""
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        """Context manager: queue the enclosed work on `stream`."""
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that `stream` reads `tensor` (allocated on another stream)."""
        tensor.record_stream(stream)
