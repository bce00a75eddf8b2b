"""The "tinker" engine kind: rollouts sampled by a Tinker-API server (the official `tinker` SDK's SamplingClient).

With `[trainer] backend = "tinker"` the optimisation runs on a Tinker-API server (trainer/backend/remote.py); the
rollouts must come from the weights it trains, and only that server has them. So the engine here generates through
a SamplingClient of the server's current weights, and a weight "sync" is `use_sampler(client, version)`: the trainer
side saves the weights for sampling (save_weights_and_get_sampling_client) and hands the new client over
(trainer.backend.remote.TinkerSync). Requests sent after the switch sample the new weights; requests already on the
server finish with the ones they started with.

Each completion carries the server's per-token log-probs of its sampled tokens (the SDK's `logprobs`: under the
distribution it sampled from, at the request's temperature) and the version of the sampler that produced it.
What the kind cannot do: named LoRA adapters (a sampler is one adapter's weights), ignore_eos, weight transfer by
broadcast or disk (the server keeps its weights), pausing in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.protocol import Completion, EngineError, SamplingParams


class TinkerEngine:
    """InferenceEngine over a Tinker-API server's SamplingClient. Mutable state: the current sampler and its
    version (swapped by `use_sampler`)."""

    def __init__(self, url: str, *, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self._sampler: Any = None  # tinker.SamplingClient of the newest weights (None before the first sync)
        self.version = -1

    def use_sampler(self, sampler: Any, version: int) -> None:
        """Sample from `sampler` (a tinker.SamplingClient) from now on; its completions report `version`."""
        self._sampler, self.version = sampler, version

    # -- generation ------------------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       rids: Sequence[str] | None = None, adapter: str | None = None) -> list[list[Completion]]:
        if adapter is not None:
            raise EngineError(f"adapter {adapter!r}: a tinker engine samples its training client's weights and "
                              f"serves no named adapters", status=404)
        if params.ignore_eos:
            raise EngineError("ignore_eos: the Tinker API's SamplingParams cannot ignore the end of sequence",
                              status=400)
        if self._sampler is None:
            raise EngineError(f"{self.url}: no sampler yet: the trainer's first weight sync (TinkerSync.sync) gives "
                              f"the engine its SamplingClient", status=503)
        sampler, version = self._sampler, self.version  # one snapshot for the whole request
        futures = [self._sample(sampler, prompt, params) for prompt in prompts]
        out = []
        for prompt, fut in zip(prompts, futures):
            response = await _wait(fut)
            out.append([Completion(output_ids=list(seq.tokens), logprobs=[float(x) for x in seq.logprobs],
                                   finish_reason="stop" if seq.stop_reason == "stop" else "length",
                                   weight_version=version, prompt_ids=list(prompt))
                        for seq in response.sequences])
        return out

    @staticmethod
    def _sample(sampler: Any, prompt: Sequence[int], params: SamplingParams) -> Any:
        from tinker import types

        sp = types.SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                                  top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                                  stop=list(params.stop_token_ids) or None)
        return sampler.sample(types.ModelInput.from_ints(list(prompt)), params.n, sp)

    # -- control ----------------------------------------------------------------------------------------
    async def health(self) -> bool:
        return self._sampler is not None

    async def get_weight_version(self) -> int:
        return self.version

    async def load_adapter(self, name: str, path: str) -> None:
        raise EngineError("a tinker engine serves no named adapters (its sampler is the training client's)",
                          status=400)

    async def unload_adapter(self, name: str) -> None:
        raise EngineError(f"adapter {name!r}: a tinker engine serves no named adapters", status=404)

    async def abort(self, rids: Sequence[str] | None = None) -> None:
        """Nothing to cut here: a request runs on the server to its end (the API has no abort)."""

    async def pause_generation(self) -> None:
        """No in-place pause: the server samples each request with the sampler it was sent to."""

    async def continue_generation(self) -> None:
        """See pause_generation."""

    async def flush_cache(self) -> None:
        """The server's caches are its own."""

    async def aclose(self) -> None:
        """The SDK's connections live in its own event loop thread: nothing per event loop to close."""

    # -- weight sync: not by transfer ---------------------------------------------------------------------
    async def world_size(self) -> int:
        return 0

    async def weight_formats(self) -> tuple[str, ...]:
        return ()

    async def colocation_info(self) -> dict:
        return {}

    async def colocated_weights(self, body: dict) -> dict:
        raise self._no_transfer()

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        return None

    async def init_weights_update_group(self, **kw: Any) -> None:
        raise self._no_transfer()

    async def update_weights_from_distributed(self, meta: dict) -> None:
        raise self._no_transfer()

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        raise self._no_transfer()

    def _no_transfer(self) -> EngineError:
        return EngineError(f"{self.url}: a tinker engine takes no weights: the server trains them, and the trainer "
                           f"hands the engine a new SamplingClient (trainer.backend.remote.TinkerSync)", status=400)


async def _wait(api_future: Any) -> Any:
    """The SDK future's result, awaited from trio or asyncio (the SDK runs its requests in its own thread)."""
    from engines.local import wait_future

    try:
        return await wait_future(api_future.future())
    except Exception as e:  # noqa: BLE001 - the SDK's errors become the protocol's, with the cause
        raise EngineError(f"tinker sampling failed: {type(e).__name__}: {e}") from e
