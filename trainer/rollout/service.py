"""The rollout service: the training loop's one source of rollout batches, whatever generates them.

    with rollout_service(buffer, config, manager, sender, rank, ...) as source:
        batch = source.next(step)          # the batch of `step`, the same on every rank (collective)
        source.requeue(groups)             # groups past the staleness bound: generated again, later
        with source.paused(load=sync) as seconds:   # sync() loads new weights into the engines
            evaluate()                               # the engines serve them; no batch starts meanwhile

One interface (`RolloutBackend`: take, paused, requeue, close; each take returns the rollout state right after its
batch was drawn) and two backends behind it, both on rank 0:

    "thread"   trainer.rollout.thread_worker.ThreadBackend   a worker thread of the trainer's process
    "process"  trainer.rollout.process_worker.RolloutProcess  a process of its own (its own interpreter lock)

What is the same for every backend lives here, once: how far generation runs ahead (the staleness policy's
`ahead`: the limit of each take), which version the rollouts are measured against (`train_version`), how the engines
are paused for a weight sync (between two batches, or, with [rl] update_in_flight, in place mid-request), how the
batches and a rollout failure reach the other ranks, and the state each batch was drawn with (ResumePoints keeps it
for checkpoints: trainer.rollout.resume). A new backend is one class with those four methods and one entry in
ROLLOUT_BACKENDS (and its name in trainer.config.ROLLOUT_WORKERS).

When rank 0's rollout raises (engine gone, filters starving the batch, ...), the other ranks are waiting in the
hand-off: they get a `RolloutFailed` marker instead of a batch, every rank runs the caller's `on_failure` (a
collective checkpoint), and every rank raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from trainer.backend.steps import broadcast_from_rank0
from trainer.config import ROLLOUT_WORKERS
from trainer.rollout.resume import rollout_state
from trainer.stops import RunStopped
from trainer.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from engines.protocol import InferenceEngine
    from trainer.config import RLTrainingConfig
    from trainer.rewards.sources import RewardSources
    from trainer.rollout.manager import AsyncRolloutManager
    from trainer.weight_sync import WeightSync

T = TypeVar("T")


class RolloutBackend(Protocol):
    """What generates the batches on rank 0."""

    def take(self, step: int, limit: int) -> tuple[RolloutBatch, dict[str, Any] | None]:
        """The batch of `step` and the rollout state right after it was drawn (rollout_state; None: the caller's
        parts are the state); the backend may go on generating the batches of steps up to `limit` meanwhile."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The engines idle inside: the batch in progress finishes first, none starts until the block ends; the
        batches after it start from the version read then."""

    def requeue(self, groups: list[list[Sample]]) -> None:
        """Generate these groups again, from their prompts, first in a later batch."""

    def close(self) -> None:
        """Stop generating (the batch in progress is cancelled) and release what the backend holds."""


@dataclasses.dataclass(frozen=True)
class RolloutFailed:
    """What rank 0 broadcasts instead of a batch when its rollout raised: the error, as text."""

    error: str


class RolloutService:
    """`next(step)` gives the batch of training step `step` on every rank; a context manager that closes it.

    backend: rank 0's RolloutBackend (None on the other ranks, which receive the batches). ahead: how many steps
    past the one taken the backend may generate (StalenessPolicy.ahead; never past `num_steps`). `on_drawn(step,
    state)` runs once batch `step` is taken, with the state read right after it was drawn (ResumePoints.record; the
    other ranks pass none). engines, in_place: `paused()` pauses these engines in place mid-request ([rl]
    update_in_flight) instead of holding the backend between two batches. Mutable (the backend): a class.
    """

    def __init__(self, backend: RolloutBackend | None, *, num_steps: int, ahead: int = 0,
                 on_failure: Callable[[], None] = lambda: None,
                 on_drawn: Callable[..., None] = lambda step, state=None: None,
                 engines: Sequence[InferenceEngine] = (), in_place: bool = False) -> None:
        assert ahead >= 0, ahead
        self._backend = backend
        self._num_steps = num_steps
        self._ahead = ahead
        self._on_failure = on_failure
        self._on_drawn = on_drawn
        self._engines = tuple(engines)
        self._in_place = in_place

    def next(self, step: int) -> RolloutBatch:
        """The batch of training step `step` (1-based), the same on every rank. Collective: every rank calls it."""
        failure: Exception | None = None
        try:
            batch = self._take(step) if self._backend is not None else None
        except Exception as e:
            failure, batch = e, RolloutFailed(f"{type(e).__name__}: {e}")
        batch = broadcast_from_rank0(batch)
        if isinstance(batch, RolloutFailed):
            # The trainer state is consistent: every rank runs on_failure (a checkpoint: collective), then every
            # rank raises, rank 0 its own exception.
            self._on_failure()
            if failure is not None:
                raise failure
            raise RunStopped(f"the rollout on rank 0 failed at step {step}: {batch.error}")
        if self._backend is None:
            self._on_drawn(step)  # the other ranks: their (unused) copies are what rank 0's were
        return batch

    def _take(self, step: int) -> RolloutBatch:
        batch, state = self._backend.take(step, min(step + self._ahead, self._num_steps))
        self._on_drawn(step, state)
        return batch

    def requeue(self, groups: list[list[Sample]]) -> None:
        """Hand groups back to the rollout side (past the staleness bound: generated again, later). The other ranks'
        copies of them are dropped: rank 0 generates."""
        if self._backend is not None:
            self._backend.requeue(groups)

    @contextlib.contextmanager
    def paused(self, load: Callable[[], T] = lambda: None) -> Iterator[T]:
        """No batch starts in the block; `load` (a weight sync) runs first with the engines paused for it, and its
        result is what the block gets. The pause is the policy's: with `in_place` ([rl] update_in_flight) the engines
        stop at their next decode step, their running requests kept with their KV cache, load, and go on (the
        tokens after it from the new weights; the block then runs beside them); otherwise the batch being
        generated finishes first and the engines stay idle for the whole block (an evaluation there does not mix
        its requests with a batch's: deterministic runs stay reproducible)."""
        if self._backend is None:  # the other ranks: their part of the sync (a collective)
            yield load()
        elif self._in_place:
            with paused_in_place(self._engines):
                loaded = load()
            yield loaded
        else:
            with self._backend.paused():
                yield load()

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def paused_in_place(engines: Sequence[InferenceEngine]) -> Iterator[None]:
    """The engines stop at their next decode step boundary, their running requests kept in place with their KV
    cache, for the block (a weight load); then they go on."""
    import trio

    async def each(pause: bool) -> None:
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(engine.pause_generation if pause else engine.continue_generation)

    trio.run(each, True)
    try:
        yield
    finally:
        trio.run(each, False)


# ------------------------------------------------------------------------------------------------ the backends
def _thread_backend(data_buffer: Any, config: RLTrainingConfig, manager: AsyncRolloutManager,
                    version: Callable[[], int], *, rewards: RewardSources, worker_cpus: tuple[int, ...] | None,
                    first_step: int) -> RolloutBackend:
    """Rank 0's rollouts in a worker thread (async) or in the step's thread (synchronous). Reward models and judges
    (`rewards`' per-batch sources) score each batch right after its generation, in the same thread."""
    from trainer.rewards.sources import scored_batches
    from trainer.rollout.manager import generate_rollout_batches
    from trainer.rollout.thread_worker import ThreadBackend

    batches = scored_batches(generate_rollout_batches(data_buffer, config.rollout, manager=manager,
                                                      weight_version=version), rewards)
    return ThreadBackend(batches, threaded=config.staleness.ahead > 0, worker_cpus=worker_cpus,
                         state=lambda: rollout_state(data_buffer, manager), requeue=manager.requeue,
                         cancel=manager.cancel)


def _process_backend(data_buffer: Any, config: RLTrainingConfig, manager: AsyncRolloutManager,
                     version: Callable[[], int], *, rewards: RewardSources, worker_cpus: tuple[int, ...] | None,
                     first_step: int) -> RolloutBackend:
    """Rank 0's rollouts in a process of their own, built from the buffer's and manager's state as they are now
    (trainer.rollout.process_worker)."""
    from trainer.rollout.process_worker import RolloutProcess, RolloutRecipe

    if rewards.recipe is None:
        raise ValueError("[rl] rollout_worker = \"process\" rebuilds the reward sources in the rollout process: "
                         "build them with trainer.rewards.sources.build_reward_sources (it records the recipe)")
    recipe = RolloutRecipe(data_buffer=data_buffer, rollout=config.rollout, engines=tuple(manager.engines),
                           tokenizer=manager.tokenizer, rewards=rewards.recipe, deterministic=config.deterministic,
                           manager_state=manager.state_dict(), first_step=first_step, cpus=worker_cpus)
    return RolloutProcess(recipe, version=version)


ROLLOUT_BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"thread": _thread_backend, "process": _process_backend}
assert tuple(ROLLOUT_BACKENDS) == ROLLOUT_WORKERS, "[rl] rollout_worker's choices are the backends here"


def rollout_service(data_buffer: Any, config: RLTrainingConfig, manager: AsyncRolloutManager, sender: WeightSync,
                    rank: int, *, on_failure: Callable[[], None], on_drawn: Callable[..., None],
                    rewards: RewardSources, worker_cpus: tuple[int, ...] | None = None,
                    first_step: int = 1) -> RolloutService:
    """The run's rollout service: rank 0 drives the rollouts with the backend [rl] rollout_worker names; every rank
    gets every batch, or its failure. The rollouts are measured against the version their batch trains at, at the
    latest (StalenessPolicy.train_version of the engines' version), so the manager restarts cached partial samples
    that would be past the bound by then."""
    policy = config.staleness
    backend = None
    if rank == 0:
        build = ROLLOUT_BACKENDS[config.rollout_worker]
        backend = build(data_buffer, config, manager, lambda: policy.train_version(sender.weight_version),
                        rewards=rewards, worker_cpus=worker_cpus, first_step=first_step)
    batches = -(-config.num_steps // config.ppo_epochs)  # the service counts batches (ppo_epochs steps each)
    return RolloutService(backend, num_steps=batches, ahead=policy.ahead, on_failure=on_failure,
                          on_drawn=on_drawn, engines=manager.engines, in_place=config.update_in_flight)
