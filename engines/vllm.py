"""Adapter for a vLLM server: OpenAI `/v1/completions` for generation, the RLHF weight-transfer routes for sync.

Pinned to vLLM v0.25.0 (docs.vllm.ai/en/v0.25.0/training/weight_transfer/ and
vllm/entrypoints/serve/dev/rlhf/api_router.py), served with
`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'`:

    POST /init_weight_transfer_engine  {"init_info": {master_address, master_port, rank_offset, world_size}}
    POST /start_weight_update          {}
    POST /update_weights               {"update_info": {names, dtype_names, shapes, packed,
                                                        packed_buffer_size_bytes, packed_num_buffers}}
    POST /finish_weight_update         {"weight_version": "N"}
    POST /pause, POST /resume, GET /health, POST /reset_prefix_cache
    POST /v1/completions {model, prompt: [[ids]], max_tokens, temperature, top_p, top_k, n, seed,
                          stop_token_ids, ignore_eos, logprobs: 0, return_token_ids: true}

NOT run against a real vLLM (no GPU/vLLM here): tests check every request against this schema on a loopback
recording server. Known gap: vLLM's workers join the group through vLLM's own StatelessProcessGroup + PyNccl, a
different rendezvous from our TCPStore/ProcessGroupNCCL, so the byte transport needs the trainer to build the
group with vLLM's `NCCLWeightTransferEngine.trainer_init` (this adapter does the HTTP control plane only). Use
`WeightSyncSender(mode="per_tensor")` (vLLM's unpacked path: one broadcast per tensor, in order); our
flattened buckets are not vLLM's packed layout, so bucketed metadata is refused with an error.

vLLM v0.25 reports no weight version per completion; the adapter stamps completions with the version it last
set through /finish_weight_update (exact when generation is paused around updates, which the sender does not do
for you: call pause_generation()/continue_generation() around a sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from engines.protocol import Completion, SamplingParams
from engines.sglang import EngineError

VLLM_VERSION = "0.25.0"
PACKED_NUM_BUFFERS = 2


def completions_payload(model: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict:
    body = {"model": model, "prompt": [list(p) for p in prompts], "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "n": params.n,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def _token_ids(choice: dict) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    # return_tokens_as_token_ids renders every token as "token_id:<id>"
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def parse_completions(data: dict, prompts: Sequence[Sequence[int]], n: int, version: int) -> list[list[Completion]]:
    choices = sorted(data.get("choices") or [], key=lambda c: c["index"])  # index = prompt * n + sample
    if len(choices) != len(prompts) * n:
        raise EngineError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts x n={n}")
    out = []
    for i, prompt in enumerate(prompts):
        group = []
        for c in choices[i * n:(i + 1) * n]:
            lps = [float(x) for x in c["logprobs"]["token_logprobs"]]
            reason = {"stop": "stop", "length": "length"}.get(c.get("finish_reason"), "abort")
            group.append(Completion(_token_ids(c), lps, reason, version, list(prompt)))
        out.append(group)
    return out


def update_info_from_meta(meta: dict) -> dict:
    """Our /update_weights_from_distributed metadata (per-tensor mode) -> vLLM's NCCL update_info."""
    if meta.get("load_format") not in (None, ""):
        raise ValueError("vLLM's packed layout differs from flattened buckets: sync vLLM engines with "
                         "WeightSyncSender(mode='per_tensor')")
    return {"names": list(meta["names"]), "dtype_names": list(meta["dtypes"]),
            "shapes": [list(s) for s in meta["shapes"]], "packed": False}


class VLLMEngine:
    """One vLLM OpenAI-compatible server (InferenceEngine protocol)."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, timeout_s: float = 300.0):
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.weight_version = 0

    async def _call(self, method: str, route: str, body: dict | None = None):
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
                r = await client.request(method, self.url + route, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"{self.url}{route}: no answer ({type(e).__name__}: {e})") from e
        if r.status_code >= 400:
            raise EngineError(f"{self.url}{route}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            return {}

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
            return True
        except EngineError:
            return False

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        version = self.weight_version
        data = await self._call("POST", "/v1/completions", completions_payload(self.model, prompts, params))
        return parse_completions(data, prompts, params.n, version)

    async def get_weight_version(self) -> int:
        return self.weight_version

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "", backend: str = "nccl",
                                        timeout_s: float | None = None) -> None:
        if backend != "nccl":
            raise ValueError(f"vLLM's weight transfer is NCCL only, got backend={backend!r}")
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size}})

    async def update_weights_from_distributed(self, meta: dict) -> None:
        info = update_info_from_meta(meta)
        version = meta.get("weight_version")
        await self._call("POST", "/start_weight_update", {})
        await self._call("POST", "/update_weights", {"update_info": info})
        await self._call("POST", "/finish_weight_update",
                         {"weight_version": None if version is None else str(version)})
        if version is not None:
            self.weight_version = int(version)

    async def pause_generation(self) -> None:
        await self._call("POST", "/pause")

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume")

    async def flush_cache(self) -> None:
        await self._call("POST", "/reset_prefix_cache")
