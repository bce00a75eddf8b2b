"""Client for SGLang's native HTTP protocol; drives the embedded engine and a real SGLang server alike.

Request fields follow SGLang's io_struct: /generate {input_ids, sampling_params{temperature, top_p, top_k,
max_new_tokens, stop_token_ids, n, sampling_seed}, return_logprob}; /init_weights_update_group {master_address,
master_port, rank_offset, world_size, group_name, backend}; /update_weights_from_distributed {names, dtypes, shapes,
group_name, flush_cache, weight_version, load_format}. Responses: generate -> {output_ids, meta_info{finish_reason,
output_token_logprobs [[logprob, id, text]], weight_version}}; weight routes -> {success, message}.

Extensions only the embedded engine reads (a stock SGLang ignores or rejects them): `timeout_s` in the group init,
the flattened_bucket `offsets/bucket_index/bucket_nbytes` fields, and the `seed` alias of `sampling_seed`.
Every call has a timeout (httpx); errors raise EngineError with the URL, route, status and the server's message.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from engines.protocol import Completion, SamplingParams


class EngineError(RuntimeError):
    """An engine answered an error or not at all."""


def generate_payload(prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict:
    sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
          "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids), "n": params.n,
          "ignore_eos": params.ignore_eos}
    if params.seed is not None:
        sp["sampling_seed"] = params.seed
    return {"input_ids": [list(p) for p in prompts], "sampling_params": sp, "return_logprob": True}


def parse_generate(resp, prompts: Sequence[Sequence[int]], n: int) -> list[list[Completion]]:
    """Group a batch response (prompt-major, n per prompt) into one list per prompt."""
    outs = resp if isinstance(resp, list) else [resp]
    if len(outs) != len(prompts) * n:
        raise EngineError(f"/generate returned {len(outs)} outputs for {len(prompts)} prompts x n={n}")
    groups = []
    for i, prompt in enumerate(prompts):
        group = []
        for o in outs[i * n:(i + 1) * n]:
            meta = o.get("meta_info", {})
            lps = meta.get("output_token_logprobs") or []
            reason = meta.get("finish_reason") or {}
            group.append(Completion(output_ids=list(o["output_ids"]), logprobs=[float(x[0]) for x in lps],
                                    finish_reason=reason.get("type", "length") if isinstance(reason, dict) else
                                    str(reason), weight_version=int(meta.get("weight_version") or 0),
                                    prompt_ids=list(prompt)))
        groups.append(group)
    return groups


class SGLangEngine:
    """One SGLang-protocol server. Async methods (trio or asyncio); a fresh httpx client per call keeps the
    object usable from any event loop or thread (the weight sync runs its calls on its own trio thread)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def __repr__(self):
        return f"SGLangEngine({self.url!r})"

    async def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None):
        timeout = httpx.Timeout(timeout_s or self.timeout_s, connect=min(10.0, timeout_s or self.timeout_s))
        try:
            async with httpx.AsyncClient(timeout=timeout, headers=self.headers) as client:
                r = await client.request(method, self.url + route, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"{self.url}{route}: no answer ({type(e).__name__}: {e})") from e
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text}
        if r.status_code >= 400 or (isinstance(data, dict) and data.get("success") is False):
            msg = data.get("message") or data.get("error") if isinstance(data, dict) else data
            raise EngineError(f"{self.url}{route}: HTTP {r.status_code}: {msg}")
        return data

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
            return True
        except EngineError:
            return False

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        data = await self._call("POST", "/generate", generate_payload(prompts, params))
        return parse_generate(data, prompts, params.n)

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info")

    async def get_weight_version(self) -> int:
        info = await self._call("GET", "/get_model_info")
        return int(info.get("weight_version") or 0)

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> None:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        await self._call("POST", "/init_weights_update_group", body, timeout_s=(timeout_s or self.timeout_s) + 5)

    async def update_weights_from_distributed(self, meta: dict) -> None:
        await self._call("POST", "/update_weights_from_distributed", meta)

    async def update_weights_from_tensor(self, body: dict) -> None:
        await self._call("POST", "/update_weights_from_tensor", body)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def pause_generation(self) -> None:
        await self._call("POST", "/pause_generation", {})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("GET", "/flush_cache")
