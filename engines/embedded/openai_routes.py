"""OpenAI's API on the embedded engine's own server: `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /v1/models`, for people who just want to sample from the engine with the `openai` SDK (no recording: training
an agent goes through the recording gateway, trainer/rollout/gateway.py, which fronts any engine).

Validation, chat-template rendering, tool-call parsing and the answers' shapes are engines/openai_wire.py's, the
gateway's own code; here only the engine side: a request is a call of the engine's own /generate handler (its
validation, adapters and continuous batching) at the request's sampling (temperature, top_p, n, seed: the j-th of n
choices uses seed + j, as /generate does; max_tokens, default: the rest of the model's context). A chat answer ends
at the template's end of turn (and the tokenizer's eos). Served names: the model (its path, as vLLM names it) and
each loaded LoRA adapter (that adapter's rows). Streaming sends the chunks once the completion is done (the engine's
batch delivers whole rows): the same chunks, all at the end. An unsupported field is a 400 naming it, an unknown
model a 404, in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engines.openai_wire import (
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    WireError,
    chat_answer,
    chat_choice,
    completion_answer,
    completion_choice,
    end_of_turn_ids,
    json_body,
    models_response,
    parse_chat_request,
    parse_completion_request,
    render_chat,
)
from engines.tool_calls import ParsedTurn, parse_hermes

Answer = tuple[dict, list[str]]  # (the response object, its SSE events when streaming)
Sample = Callable[[dict], Awaitable[list[dict]]]  # the engine's /generate handler: a body in, its outputs out


def served_names(server: Any) -> list[str]:
    """The `model` names a request may give: the engine's model (its path) and its loaded LoRA adapters."""
    return [server.model_path, *server.adapter_names()]


def _adapter(server: Any, model: str) -> str | None:
    """The adapter a request's `model` names (None: the model itself, with the engine's default adapter if set)."""
    if model == server.model_path:
        return None
    if model in server.adapter_names():
        return model
    raise WireError(f"model {model!r} is not served here; served: {served_names(server)} (GET /v1/models)",
                    param="model", status=404)


async def generate(server: Any, sample: Sample, prompt: Sequence[int], sampling: SamplingRequest, model: str,
                   stop_ids: Sequence[int] = ()) -> list[tuple[list[int], list[float], str]]:
    """The request's n completions of `prompt` ((token ids, log-probs, finish reason) each) from the engine's own
    /generate (`sample`: its handler, so the same validation, adapters and continuous batching), at the request's
    sampling."""
    context = server.model.config.max_position_embeddings
    budget = sampling.max_tokens if sampling.max_tokens is not None else context - len(prompt)
    if len(prompt) + budget > context:
        raise WireError(f"the prompt ({len(prompt)} tokens) + max_tokens ({budget}) exceed the model's context of "
                        f"{context} tokens: shorten the messages or lower max_tokens", param="max_tokens")
    sp = {"temperature": 1.0 if sampling.temperature is None else sampling.temperature,
          "top_p": 1.0 if sampling.top_p is None else sampling.top_p, "max_new_tokens": budget, "n": sampling.n,
          "seed": sampling.seed, "stop_token_ids": list(stop_ids)}
    outs = await sample({"input_ids": [list(prompt)], "sampling_params": sp, "lora_path": _adapter(server, model)})
    done = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"]["finish_reason"]["type"]) for o in outs]
    if any(finish == "abort" for _, _, finish in done):
        raise WireError("the engine aborted this request (/abort_request or a pause with mode 'abort'); send it "
                        "again", status=503)
    return done


def openai_routes(server: Any, sample: Sample, *,
                  parse: Callable[[str], ParsedTurn] = parse_hermes) -> list[Route]:
    """The three routes on `server` (an engines.embedded.server.EngineServer) whose /generate handler is `sample`
    (its refusals raised as WireError); `parse` reads tool calls out of a chat answer when the request gives
    `tools` (Hermes `<tool_call>` by default)."""
    tok = server.tokenizer
    turn_end = end_of_turn_ids(tok)

    async def chat(req: ChatRequest) -> Answer:
        try:
            prompt = render_chat(tok, req.messages, req.tools)
        except Exception as e:  # noqa: BLE001 - the template's own error (jinja, a role it refuses) names the cause
            raise WireError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                            param="messages") from e
        results = await generate(server, sample, prompt, req.sampling, req.model, turn_end)
        shaped = [chat_choice(i, ids, lps, finish, req, tokenizer=tok, parse=parse)
                  for i, (ids, lps, finish) in enumerate(results)]
        return chat_answer(req.model, shaped, len(prompt), req.sampling)

    async def completion(req: CompletionRequest) -> Answer:
        prompt = list(req.prompt) if isinstance(req.prompt, tuple) else tok(req.prompt)["input_ids"]
        results = await generate(server, sample, prompt, req.sampling, req.model)
        shaped = [completion_choice(i, ids, lps, finish, req, tokenizer=tok)
                  for i, (ids, lps, finish) in enumerate(results)]
        return completion_answer(req.model, shaped, len(prompt), req.sampling)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(models_response(served_names(server)))

    return [Route("/v1/chat/completions", _post(parse_chat_request, chat), methods=["POST"]),
            Route("/v1/completions", _post(parse_completion_request, completion), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"])]


def _post(parse: Callable[[Any], Any], answer: Callable[[Any], Awaitable[Answer]]) -> Callable:
    """A starlette handler: the body validated by `parse`, answered by `answer`; errors in OpenAI's shape."""

    async def handler(request: Request) -> Any:
        try:
            body = json_body(await request.body())
            req = parse(body)
            response, chunks = await answer(req)
        except WireError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except ValueError as e:  # e.g. a bad adapter or sampling value the engine refused
            return JSONResponse(WireError(str(e)).body(), status_code=400)
        except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
            err = WireError(f"the engine could not answer: {type(e).__name__}: {e}", status=500)
            return JSONResponse(err.body(), status_code=500)
        if req.sampling.stream:
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        return JSONResponse(response)

    return handler
