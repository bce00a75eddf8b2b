"""The Tinker API's routes (tinker SDK 0.38: tinker/resources, tinker/lib), one small function each.

A handler takes (service, JSON body + path parameters) and returns a JSON-able dict; the ones that queue work
answer {"request_id"} (an UntypedAPIFuture) and put the work's coroutine in `service.submit`, keyed by the SDK's
(owner, seq_id) so a retried request runs once. The SDK's request and response shapes are tinker.types'.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import torch

from engines.protocol import SamplingParams as EngineParams
from trainer.backend.protocol import AdamParams, BackendFuture
from trainer.serve import wire
from trainer.serve.clients import Service, TrainingModel, UserError


def _future(request_id: str, model_id: str | None = None) -> dict:
    return {"request_id": request_id, "model_id": model_id}


def _checked_name(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"checkpoint name {name!r}: a plain name (no '/', not starting with '.')")
    return name


def _queue(service: Service, key: tuple, start, encode) -> str:
    """Queue `start()` (a BackendFuture, or a ValueError raised at once for bad input) and answer its request id;
    `encode(result)` gives the future's payload."""
    if key in service.seen:
        return service.seen[key]
    if service.stopping:  # the workers are shut down: answered "cancelled", as stop_work promises, nothing started
        return service.fail(UserError("the server is shutting down"), key)
    try:
        fut: BackendFuture = start()
    except ValueError as e:
        return service.fail(UserError(str(e)), key)

    async def work() -> tuple[str, Any]:
        return encode(await fut.aresult())
    return service.submit(work(), key)


# ---------------------------------------------------------------------------------------------------------
# Service, sessions
# ---------------------------------------------------------------------------------------------------------


async def healthz(service: Service, body: dict) -> dict:
    return {"status": "ok"}


async def capabilities(service: Service, body: dict) -> dict:
    import transformers

    models = []
    for name, path in service.model_paths.items():
        config = transformers.AutoConfig.from_pretrained(path)
        models.append({"model_name": name, "max_context_length": getattr(config, "max_position_embeddings", None),
                       "trainable": True, "sampleable": True})
    return {"supported_models": models}


async def client_config(service: Service, body: dict) -> dict:
    # Serial fwd/bwd chunks (the server runs them in arrival order), plain httpx, no compression, per-request polling.
    return {"parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False, "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False, "pjwt_auth_enabled": False}


async def dynamic_config(service: Service, body: dict) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


async def create_session(service: Service, body: dict) -> dict:
    return {"type": "create_session", "session_id": service.new_session(body)}


async def heartbeat(service: Service, body: dict) -> dict:
    """A finished session answers 410 (Service.session): the SDK ends its heartbeat loop on that status only."""
    service.session(body.get("session_id"))["heartbeats"] += 1
    return {"type": "session_heartbeat"}


async def finish_session(service: Service, body: dict) -> dict:
    """ServiceClient.close(status): the session takes no new clients and its heartbeats answer 410; its training
    clients, samplers and checkpoints stay (the RestClient still lists them). The first reason wins, as the SDK
    documents; finishing twice is no error."""
    session = service.sessions.get(body.get("session_id"))
    if session is None:
        raise UserError(f"unknown session_id {body.get('session_id')!r}", status=404)
    if session["finished"] is None:
        session["finished"] = (body.get("reason") or {}).get("type") or "finished"
    return {"status": "finished"}


async def accepted(service: Service, body: dict) -> dict:
    """Telemetry, cancel: accepted and dropped."""
    return {"status": "accepted"}


# ---------------------------------------------------------------------------------------------------------
# Training clients
# ---------------------------------------------------------------------------------------------------------


async def create_model(service: Service, body: dict) -> dict:
    session_id, seq = body.get("session_id", ""), body.get("model_seq_id", 0)
    model_id = f"{session_id}:train:{seq}"  # the SDK derives the same id in create_training_client_from_state
    key = (session_id, seq, "create_model")
    if key in service.seen:
        return _future(service.seen[key], model_id)
    if session_id in service.sessions:  # raw callers may leave the session out
        service.session(session_id)

    async def work() -> tuple[str, Any]:
        record = await asyncio.to_thread(service.create_model, {**body, "model_id": model_id})
        return "json", {"type": "create_model", "model_id": record.model_id}
    return _future(service.submit(work(), key), model_id)


def _info(record: TrainingModel) -> dict:
    return {"type": "get_info", "model_id": record.model_id, "is_lora": True, "lora_rank": record.spec.rank,
            "model_name": record.base_name,
            "model_data": {"model_name": record.base_name, "tokenizer_id": record.backend.base.path,
                           "arch": record.backend.base.model.config.model_type}}  # tokenizer_id: the SDK loads it


async def get_info(service: Service, body: dict) -> dict:
    return _info(service.model(body["model_id"]))


async def unload_model(service: Service, body: dict) -> dict:
    record = service.model(body["model_id"])

    async def work() -> tuple[str, Any]:
        service.unload(record.model_id)
        await service.release_snapshots(record.model_id)
        return "json", {"type": "unload_model", "model_id": record.model_id}
    return _future(service.submit(work()), record.model_id)


async def forward_backward(service: Service, request) -> dict:
    """The SDK's protobuf body (trainer/serve/wire.py); forward_only = `forward`."""
    header, data = wire.decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
    record = service.model(header["model_id"])
    backend = record.backend
    run = backend.forward if header["forward_only"] else backend.forward_backward
    key = (record.model_id, header["seq_id"], "train")
    request_id = _queue(service, key, lambda: run(data, header["loss_fn"], header["loss_fn_config"]),
                        lambda out: ("proto", wire.encode_forward_output(out)))
    return _future(request_id, record.model_id)


async def optim_step(service: Service, body: dict) -> dict:
    record = service.model(body["model_id"])
    key = (record.model_id, body.get("seq_id"), "train")
    given = body.get("adam_params", body.get("optim_params"))
    if not isinstance(given, dict):  # the SDK sends other optimizers' parameters as optimizer_params
        what = "optimizer_params (another optimizer's)" if "optimizer_params" in body else "no adam_params"
        return _future(service.fail(UserError(f"optim_step: {what}: this server trains with AdamW; give "
                                              f"AdamParams"), key), record.model_id)
    params = AdamParams(**{k: float(v) for k, v in given.items() if k in AdamParams.__dataclass_fields__})
    request_id = _queue(service, key, lambda: record.backend.optim_step(params),
                        lambda metrics: ("json", {"metrics": metrics}))
    return _future(request_id, record.model_id)


async def save_weights(service: Service, body: dict) -> dict:
    """save_state: adapter + optimizer state under tinker://<model_id>/weights/<name>."""
    record = service.model(body["model_id"])
    name = _checked_name(body.get("path") or f"state-{body.get('seq_id')}")
    key = (record.model_id, body.get("seq_id"), "train")
    if not body.get("overwrite") and (service.output_dir / record.model_id / "weights" / name).exists() and \
            key not in service.seen:  # the SDK's save_state(name, overwrite=False): an existing checkpoint stays
        return _future(service.fail(UserError(f"checkpoint {name!r} of {record.model_id} exists: save under another "
                                              f"name, or pass overwrite=True"), key), record.model_id)

    def done(folder: str) -> tuple[str, Any]:
        from pathlib import Path

        return "json", {"type": "save_weights",
                        "path": service.record_checkpoint(record, "weights", name, Path(folder))}
    return _future(_queue(service, key, lambda: record.backend.save_state(f"weights/{name}"), done), record.model_id)


async def save_for_sampler(service: Service, body: dict) -> dict:
    """With a name: the adapter as a PEFT folder under tinker://<model_id>/sampler_weights/<name>. Without (the
    SDK's save_weights_and_get_sampling_client): the adapter tensors go to the engine in memory, no disk, and the
    answer names the new sampling session."""
    record = service.model(body["model_id"])
    key = (record.model_id, body.get("seq_id"), "train")
    if body.get("path"):
        name = _checked_name(body["path"])

        def saved(folder: str) -> tuple[str, Any]:
            from pathlib import Path

            path = service.record_checkpoint(record, "sampler_weights", name, Path(folder))
            return "json", {"type": "save_weights_for_sampler", "path": path}
        return _future(_queue(service, key, lambda: record.backend.save_weights(f"sampler_weights/{name}"), saved),
                       record.model_id)
    if key in service.seen:
        return _future(service.seen[key], record.model_id)
    if service.stopping:
        return _future(service.fail(UserError("the server is shutting down"), key), record.model_id)
    weights = record.backend.get_weights()  # queued behind this client's earlier requests

    async def work() -> tuple[str, Any]:
        sampler_id = await service.sampler_from_weights(record, f"seq{body.get('seq_id')}", await weights.aresult())
        return "json", {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id, "path": None}
    return _future(service.submit(work(), key), record.model_id)


async def load_weights(service: Service, body: dict) -> dict:
    """load_state (into an existing client) or create_training_client_from_state (a new client from the
    checkpoint's LoRA shape: model_id = <session_id>:train:<model_seq_id>, as the SDK derives it)."""
    folder, _ = service.checkpoint_folder(body["path"])
    optimizer = bool(body.get("optimizer", False))
    if body.get("model_id"):
        record = service.model(body["model_id"])
        key = (record.model_id, body.get("seq_id"), "train")
        request_id = _queue(service, key, lambda: record.backend.load_state(str(folder), optimizer),
                            lambda _: ("json", {"type": "load_weights", "path": body["path"],
                                                "model_id": record.model_id}))
        return _future(request_id, record.model_id)
    config = json.loads((folder / "adapter_config.json").read_text())
    base = next((n for n, p in service.model_paths.items() if p == config["base_model_name_or_path"]), None)
    targets = set(config["target_modules"])
    lora = {"rank": config["r"], "train_attn": bool(targets & {"q_proj", "v_proj"}),
            "train_mlp": bool(targets & {"up_proj", "down_proj"}), "train_unembed": "lm_head" in targets}
    created = await create_model(service, {"session_id": body.get("session_id", ""), "base_model": base,
                                           "model_seq_id": body.get("model_seq_id", 0), "lora_config": lora})
    model_id = created["model_id"]
    first = service.futures[created["request_id"]].task

    async def work() -> tuple[str, Any]:
        await first
        try:
            await service.model(model_id).backend.load_state(str(folder), optimizer).aresult()
        except BaseException:  # e.g. a sampler checkpoint loaded with its optimizer: the client is not kept
            if model_id in service.models:
                service.unload(model_id)
            raise
        return "json", {"type": "load_weights", "path": body["path"], "model_id": model_id}
    return _future(service.submit(work()), model_id)


# ---------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------


async def create_sampling_session(service: Service, body: dict) -> dict:
    if (body.get("base_model") is None) == (body.get("model_path") is None):
        raise UserError("create_sampling_session: give exactly one of base_model and model_path")
    if body.get("session_id") in service.sessions:
        service.session(body["session_id"])
    sampler_id = await service.sampler_from_path(body.get("base_model"), body.get("model_path"))
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


async def get_sampler(service: Service, body: dict) -> dict:
    s = service.sampler(body["sampler_id"])
    return {"sampler_id": s.sampler_id, "base_model": s.base_name, "model_path": s.model_path}


def _engine_params(sp: dict, n: int, tokenizer) -> tuple[EngineParams, list[str]]:
    """The engine's sampling parameters and the stop strings (applied to the decoded text afterwards)."""
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    ids = tuple(s for s in stop if isinstance(s, int))
    strings = [s for s in stop if isinstance(s, str)]
    max_tokens = sp.get("max_tokens")
    params = EngineParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                          top_k=int(sp.get("top_k", -1)), max_new_tokens=int(max_tokens if max_tokens is not None
                                                                                 else 128),
                          stop_token_ids=ids, n=n, seed=sp.get("seed"))
    return params, strings


def _cut_at_stop(tokens: list[int], logprobs: list[float], strings: list[str], tokenizer) -> tuple | None:
    """The shortest prefix whose text contains a stop string (tokens, logprobs), or None."""
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in strings):
            return tokens[:k], logprobs[:k]
    return None


async def asample(service: Service, body: dict) -> dict:
    owner = body.get("sampling_session_id")
    key = (owner, body.get("seq_id"), "sample") if owner and body.get("seq_id") is not None else None
    if key is not None and key in service.seen:
        request_id = service.seen[key]
    else:
        request_id = service.submit(_sample(service, body), key, owner=owner)
    n = int(body.get("num_samples", 1))  # the SDK stamps each returned sequence with one of these ids
    return {**_future(request_id), "sample_sequence_ids": [f"{request_id}/{j}" for j in range(n)]}


async def _sample(service: Service, body: dict) -> tuple[str, Any]:
    if body.get("sampling_session_id"):
        sampler = service.sampler(body["sampling_session_id"])
    else:
        sampler = await service.direct_sampler(body.get("base_model"), body.get("model_path"))
    prompt = [int(t) for c in body["prompt"]["chunks"] for t in c.get("tokens", [])]
    base = await service.base_async(sampler.base_name)
    bad = [t for t in prompt if not 0 <= t < base.vocab_size]
    if not prompt or bad:
        raise UserError(f"prompt: token ids {bad[:3]} outside the vocabulary [0, {base.vocab_size})" if bad
                        else "prompt: no tokens")
    tokenizer = await service.tokenizer_async(sampler.base_name)
    params, strings = _engine_params(body.get("sampling_params") or {}, int(body.get("num_samples", 1)), tokenizer)
    if base.max_positions is not None and len(prompt) + params.max_new_tokens > base.max_positions:
        raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens}) exceed the model's "
                        f"context of {base.max_positions}")
    engine = await service.engine_async(sampler.base_name)
    completions = (await engine.generate([prompt], params, adapter=sampler.adapter))[0]
    sequences = []
    for c in completions:
        cut = _cut_at_stop(c.output_ids, c.logprobs, strings, tokenizer) if strings else None
        reason = "stop" if cut is not None or c.finish_reason == "stop" else "length"
        tokens, logprobs = cut if cut is not None else (c.output_ids, c.logprobs)
        sequences.append((tokens, logprobs, reason))
    prompt_lp = None
    if body.get("prompt_logprobs"):
        ids = torch.tensor(prompt, dtype=torch.long)
        lp = await base.submit(lambda: base.score(ids, sampler.spec, sampler.weights)).aresult()
        prompt_lp = [math.nan] + lp.tolist()  # the first token has no context
        last_n = body.get("prompt_logprobs_last_n")
        if last_n:  # only the last N scored, the rest None (NaN on the wire), as the SDK documents
            prompt_lp = [math.nan] * (len(prompt_lp) - int(last_n)) + prompt_lp[-int(last_n):]
    return "proto", wire.encode_sample_response(sequences, prompt_lp)


async def retrieve_futures(service: Service, body: dict) -> dict:
    """The SDK's session poller (used when the client config turns it on): the sampling session's requests that
    ended after prev_cursor, waiting up to `timeout` (at most 20 s) for one."""
    target = body.get("target") or {}
    sampler = service.sampler(target.get("sampling_session_id"))
    timeout = min(float(body.get("timeout") or 20.0), 20.0)
    done, cursor = await service.completions_after(sampler.sampler_id, int(body.get("prev_cursor", 0)), timeout)
    return {"completions": [{"state": e["state"], "request_id": e["request_id"]} for e in done], "cursor": cursor}


# ---------------------------------------------------------------------------------------------------------
# Runs and checkpoints (the RestClient)
# ---------------------------------------------------------------------------------------------------------


def _run(record: TrainingModel) -> dict:
    last = {t: next((c for c in reversed(record.checkpoints) if c["checkpoint_type"] == t), None)
            for t in ("training", "sampler")}
    return {"training_run_id": record.model_id, "base_model": record.base_name, "model_owner": "local",
            "is_lora": True, "corrupted": False, "lora_rank": record.spec.rank,
            "last_request_time": record.created.isoformat(), "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"], "user_metadata": record.user_metadata}


async def training_runs(service: Service, body: dict) -> dict:
    limit, offset = int(body.get("limit", 20)), int(body.get("offset", 0))
    runs = [_run(r) for r in service.models.values()]
    return {"training_runs": runs[offset: offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


async def training_run(service: Service, body: dict) -> dict:
    return _run(service.model(body["model_id"]))


async def run_checkpoints(service: Service, body: dict) -> dict:
    return {"checkpoints": service.model(body["model_id"]).checkpoints}


async def all_checkpoints(service: Service, body: dict) -> dict:
    found = [c for r in service.models.values() for c in r.checkpoints]
    limit, offset = int(body.get("limit", 100)), int(body.get("offset", 0))
    return {"checkpoints": found[offset: offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


async def weights_info(service: Service, body: dict) -> dict:
    folder, _ = service.checkpoint_folder(body["tinker_path"])
    config = json.loads((folder / "adapter_config.json").read_text())
    targets = set(config["target_modules"])
    base = next((n for n, p in service.model_paths.items() if p == config["base_model_name_or_path"]),
                config["base_model_name_or_path"])
    return {"base_model": base, "is_lora": True, "lora_rank": config["r"], "train_unembed": "lm_head" in targets,
            "train_mlp": bool(targets & {"up_proj", "down_proj"}), "train_attn": bool(targets & {"q_proj", "v_proj"})}


ROUTES = [  # (method, path, handler, raw request)
    ("GET", "/api/v1/healthz", healthz, False),
    ("GET", "/api/v1/get_server_capabilities", capabilities, False),
    ("POST", "/api/v1/client/config", client_config, False),
    ("POST", "/api/v1/client/dynamic_config", dynamic_config, False),
    ("POST", "/api/v1/create_session", create_session, False),
    ("POST", "/api/v1/session_heartbeat", heartbeat, False),
    ("POST", "/api/v1/sessions/{session_id}/finish", finish_session, False),
    ("POST", "/api/v1/telemetry", accepted, False),
    ("POST", "/api/v1/cancel_future", accepted, False),
    ("POST", "/api/v1/create_model", create_model, False),
    ("POST", "/api/v1/get_info", get_info, False),
    ("POST", "/api/v1/unload_model", unload_model, False),
    ("POST", "/api/v1/forward_backward", forward_backward, True),
    ("POST", "/api/v1/optim_step", optim_step, False),
    ("POST", "/api/v1/save_weights", save_weights, False),
    ("POST", "/api/v1/save_weights_for_sampler", save_for_sampler, False),
    ("POST", "/api/v1/load_weights", load_weights, False),
    ("POST", "/api/v1/create_sampling_session", create_sampling_session, False),
    ("GET", "/api/v1/samplers/{sampler_id}", get_sampler, False),
    ("POST", "/api/v1/asample", asample, False),
    ("POST", "/api/v1/retrieve_futures", retrieve_futures, False),
    ("GET", "/api/v1/training_runs", training_runs, False),
    ("GET", "/api/v1/training_runs/{model_id}", training_run, False),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints", run_checkpoints, False),
    ("GET", "/api/v1/checkpoints", all_checkpoints, False),
    ("POST", "/api/v1/weights_info", weights_info, False),
]

