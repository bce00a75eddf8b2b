"""The embedded engine's scheduler (engines/embedded/server.py, EngineServer) between its two threads: the event loop
that takes requests, aborts and pauses, and the model thread that steps by itself while only the running rows need a
step. Each test holds the model thread at one point with a gate (a threading.Event) so that a request lands exactly
in the window it is about, then checks what the server answered and the decode step it answered in."""

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from engines.embedded.generation import DecodeBatch, Row
from engines.embedded.presets import build_tiny_model
from engines.embedded.server import EngineServer, route_handlers
from engines.tiny import build_tokenizer

WAIT_S = 30  # every gate and wait is bounded: a scheduler bug fails the test, it never hangs it


def _server() -> EngineServer:
    return EngineServer(build_tiny_model(5), build_tokenizer(), model_path="tiny", threads=1)


def _row(rid: str, n: int) -> Row:
    return Row((1, 17, 18, 19), 1.0, 1.0, -1, n, frozenset(), 7, rid, 0)


class Gate:
    """Holds the model thread inside the call it wraps (the `at`-th one) until the test opens it."""

    def __init__(self, at: int = 1):
        self.at, self.calls = at, 0
        self.entered, self.opened = threading.Event(), threading.Event()

    def wrap(self, fn):
        def held(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                self.entered.set()
                assert self.opened.wait(WAIT_S), "the test never opened the gate"
            return fn(*args, **kwargs)

        return held

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), "the model thread never reached the gate"


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


@contextlib.asynccontextmanager
async def _running(gate: Gate | None = None):
    """(a started server, its route handlers); at the end the gate is opened (a failed test leaves no model thread
    waiting on it) and the server stopped."""
    server = _server()
    await server.start()
    try:
        yield server, route_handlers(server)
    finally:
        if gate is not None:
            gate.opened.set()
        server.shutdown()
        server._scheduler.cancel()


@pytest.mark.parametrize("how", ["abort_request", "pause_abort"])
def test_an_abort_reaches_a_row_while_the_step_in_flight_admits_it(monkeypatch, how):
    """Was: a row taken from the queue is in no list abort() read until its prefill ended (DecodeBatch._join), so an
    abort in that window answered 0 rows and the row ran to max_new_tokens; pause(mode=abort) left it running too.
    Now it is cut at the next step: the admitting step samples its first token, the next one answers it."""
    gate = Gate()
    monkeypatch.setattr(DecodeBatch, "_prefills", gate.wrap(DecodeBatch._prefills))

    async def main():
        async with _running(gate) as (server, handlers):
            request = asyncio.create_task(server.submit([_row("r1", 60)]))
            await gate.reached()  # step 1 is prefilling the row: it has left the queue, it is not in the batch yet
            assert [r.rid for r, _ in server.admitting] == ["r1"] and len(server.batch) == 0
            if how == "abort_request":
                assert (await handlers["/abort_request"].handler({"rid": "r1"}))["aborted_rows"] == 1
            else:
                await handlers["/pause_generation"].handler({"mode": "abort"})
            gate.opened.set()
            (result,), _, step = await asyncio.wait_for(request, WAIT_S)
            assert result.finish_reason == "abort" and len(result.output_ids) == 1, result
            assert step == 2 and server.steps == 2 and len(server.batch) == 0

    asyncio.run(main())


def test_an_abort_while_paused_in_place_is_answered_while_paused():
    """Was: paused in place, the loop waited for /continue_generation only, so an abort sent after the pause was not
    applied until then and its request hung. Now the cut runs as a step that samples nothing: the request is
    answered with the tokens it had, the engine stays paused, and a continue resumes it."""

    async def main():
        async with _running() as (server, handlers):
            request = asyncio.create_task(server.submit([_row("r1", 400)]))
            await _until(lambda: server.steps >= 5, "the row to run")
            await handlers["/pause_generation"].handler({"mode": "in_place"})
            await _until(lambda: not server.stepping, "the model thread to stop")  # the loop parks, paused
            paused_at = server.steps
            assert len(server.batch) == 1
            assert (await handlers["/abort_request"].handler({"rid": "r1"}))["aborted_rows"] == 1
            (result,), _, step = await asyncio.wait_for(request, WAIT_S)
            assert result.finish_reason == "abort" and len(result.output_ids) == paused_at, (result, paused_at)
            assert step == paused_at + 1 and not server.running.is_set()  # answered while still paused
            await handlers["/continue_generation"].handler({})
            (after,), _, _ = await asyncio.wait_for(server.submit([_row("r2", 3)]), WAIT_S)
            assert after.finish_reason == "length" and len(after.output_ids) == 3

    asyncio.run(main())


def test_an_abort_of_a_row_that_finishes_in_the_step_in_flight_adds_no_step(monkeypatch):
    """The abort lands while the row's last step runs: the row finishes anyway (finish reason "length"), and the
    batch left empty takes no further step (was: the loop ran and counted one step on the empty batch)."""
    gate = Gate(at=10)  # DecodeBatch.step's 10th call: the last of a 10-token row (one token a step)
    monkeypatch.setattr(DecodeBatch, "step", gate.wrap(DecodeBatch.step))

    async def main():
        async with _running(gate) as (server, _):
            request = asyncio.create_task(server.submit([_row("r1", 10)]))
            await gate.reached()
            assert server.abort("r1") == 1  # still running: it is cut at the next step, were there one
            gate.opened.set()
            (result,), _, step = await asyncio.wait_for(request, WAIT_S)
            assert result.finish_reason == "length" and len(result.output_ids) == 10
            # the loop task ran on to its next wait before this coroutine resumed: no step was started since
            assert step == 10 and server.steps == 10 and gate.calls == 10
            assert not server.abort_all and not server.abort_rids

    asyncio.run(main())


def test_closing_the_in_process_engine_stops_the_model_threads_own_stepping(monkeypatch):
    """Was: LocalEngine.close() cancelled the scheduler and stopped its loop, but the model thread, stepping by
    itself, could not see that and decoded the batch to its end (and the interpreter's exit waited for it). Now it
    stops after the step in flight."""
    from engines.local import LocalEngine

    calls = []
    step = DecodeBatch.step

    def slow_step(self, new=()):  # a bigger model's step: the run left after close() would take ~1.5 s
        calls.append(time.monotonic())
        time.sleep(0.003)
        return step(self, new)

    monkeypatch.setattr(DecodeBatch, "step", slow_step)
    torch.manual_seed(0)
    engine = LocalEngine("tiny", threads=1)
    request = asyncio.run_coroutine_threadsafe(engine.server.submit([_row("a", 480), _row("b", 480)]), engine._loop)
    deadline = time.monotonic() + WAIT_S
    while len(calls) < 10:
        assert time.monotonic() < deadline, "the rows never ran"
        time.sleep(0.005)
    engine.close()
    at_close = len(calls)
    engine.server.model_thread.shutdown(wait=True)  # returns once the model thread has left its work
    assert len(calls) <= at_close + 1, (at_close, len(calls))  # at most the step that was in flight
    assert request.cancelled()  # the caller of the closed engine is not left waiting


def test_rows_queued_or_paused_through_a_failed_sync_fail_instead_of_decoding_mixed_weights():
    """Was: a request that passed /generate's check while a sync was in flight, or a row paused in place through
    it, decoded after the sync failed part-way (some tensors new, some old) and was answered 200. Now both fail
    with a 503, and the engine generates again once a sync succeeds."""
    from engines.embedded.server import BadRequest

    async def main():
        async with _running() as (server, handlers):
            running = asyncio.create_task(server.submit([_row("paused", 400)]))
            await _until(lambda: server.steps >= 3, "the row to run")
            await handlers["/pause_generation"].handler({"mode": "in_place"})
            await _until(lambda: not server.stepping, "the model thread to stop")
            async with server.exclusive():  # a weight load that fails part-way
                queued = asyncio.create_task(server.submit([_row("queued", 5)]))
                await _until(lambda: len(server.waiting) == 1, "the request to queue")
                server.weights_consistent = False
            await handlers["/continue_generation"].handler({})
            for task in (queued, running):
                with pytest.raises(BadRequest, match="failed part-way") as e:
                    await asyncio.wait_for(task, WAIT_S)
                assert e.value.status == 503
            assert len(server.batch) == 0 and not server.waiting
            server.weights_consistent = True  # the next sync succeeded
            (after,), _, _ = await asyncio.wait_for(server.submit([_row("after", 3)]), WAIT_S)
            assert after.finish_reason == "length" and len(after.output_ids) == 3

    asyncio.run(main())
