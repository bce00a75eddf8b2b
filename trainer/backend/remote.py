"""TinkerBackend: the TrainingBackend surface (trainer/backend/protocol.py) over any Tinker-API server.

The same calls as LocalLoraBackend, the optimisation on the server (this project's `python -m trainer serve`, or
any other server of the API) through the official `tinker` SDK: a loop written against TrainingBackend swaps one
for the other. What the API does not offer: `get_weights` / `load_weights` (a Tinker server neither sends nor
takes raw weights: sample with `sampling_client()`, move weights with save_state / load_state).

`[trainer] backend = "tinker"` (the RL loop on such a server, issue 39 item 5) adds, below: `TinkerPolicy` (the
loop's "policy" objective and [rl.optim] as Tinker's ppo / cispo and AdamParams), `TinkerSync` (a weight sync is a
new SamplingClient for the "tinker" engines, engines/tinker.py), `RemoteCheckpointer` / `remote_resume` (the
server's save_state, indexed beside the run) and `connect` (the key rules and a health probe before any work).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.backend.checkpoint import Checkpointer
from trainer.backend.protocol import AdamParams, BackendFuture, Datum, ForwardOutput, LoraSpec
from trainer.types import TrainingState


def _then(api_future: Any, fn: Callable[[Any], Any]) -> BackendFuture:
    """A BackendFuture of fn(the result of `api_future`: the SDK's APIFuture, or a BackendFuture)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(src: concurrent.futures.Future) -> None:
        try:
            out.set_result(fn(src.result()))
        except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
            out.set_exception(e)

    src = api_future._fut if isinstance(api_future, BackendFuture) else api_future.future()
    src.add_done_callback(done)
    return BackendFuture(out)


def _datums(batch: Sequence[Datum]) -> list:
    from tinker import types

    out = []
    for d in batch:
        inputs = {k: v.tolist() for k, v in d.loss_inputs.items()}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(d.tokens.tolist()), loss_fn_inputs=inputs))
    return out


def _forward_output(result: Any) -> ForwardOutput:
    outputs = [{k: torch.tensor(v.tolist(), dtype=torch.float32) for k, v in o.items()}
               for o in result.loss_fn_outputs]
    return ForwardOutput(outputs=outputs, metrics=dict(result.metrics))


class TinkerBackend:
    """One LoRA training client on a Tinker-API server. Mutable state: the SDK's clients."""

    def __init__(self, base_url: str, base_model: str, spec: LoraSpec, *, api_key: str | None = None) -> None:
        import tinker

        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.client = self.service.create_lora_training_client(
            base_model=base_model, rank=spec.rank, seed=spec.seed, train_mlp=spec.train_mlp,
            train_attn=spec.train_attn, train_unembed=spec.train_unembed).result()

    def close(self, status: str = "success", timeout_s: float = 30.0) -> None:
        """Finish the SDK session: its heartbeat thread stops (left running, it prints "Session heartbeat failed"
        once the server is gone). The server keeps the run's checkpoints. A server already gone is a warning."""
        import warnings

        try:
            self.service.close(status).result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - closing must not hide the run's own outcome
            warnings.warn(f"closing the Tinker session failed: {type(e).__name__}: {e}", stacklevel=2)

    def forward(self, batch: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture:
        return _then(self.client.forward(_datums(batch), loss_fn, loss_fn_config), _forward_output)

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture:
        return _then(self.client.forward_backward(_datums(batch), loss_fn, loss_fn_config), _forward_output)

    def optim_step(self, adam_params: AdamParams) -> BackendFuture:
        from tinker import types

        params = types.AdamParams(learning_rate=adam_params.learning_rate, beta1=adam_params.beta1,
                                  beta2=adam_params.beta2, eps=adam_params.eps,
                                  weight_decay=adam_params.weight_decay, grad_clip_norm=adam_params.grad_clip_norm)
        return _then(self.client.optim_step(params), lambda r: dict(r.metrics or {}))

    def save_state(self, name: str) -> BackendFuture:
        """The server's checkpoint path (tinker://...), which load_state takes."""
        return _then(self.client.save_state(name), lambda r: r.path)

    def load_state(self, path: str, optimizer: bool = True) -> BackendFuture:
        import warnings

        with warnings.catch_warnings():  # the SDK prefers a new client from the state; this one keeps its id
            warnings.simplefilter("ignore", FutureWarning)
            load = self.client.load_state_with_optimizer if optimizer else self.client.load_state
            return _then(load(path), lambda r: None)

    def get_weights(self) -> BackendFuture:
        raise NotImplementedError("a Tinker-API server does not send weights: sample through sampling_client(), "
                                  "or save_state and load it elsewhere")

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> BackendFuture:
        raise NotImplementedError("a Tinker-API server does not take raw weights: load_state a checkpoint of it")

    def sampling_client(self) -> Any:
        """The SDK's SamplingClient of the current weights (save_weights_and_get_sampling_client)."""
        return self.client.save_weights_and_get_sampling_client().result()


# ---------------------------------------------------------------------------------------------------------
# The RL loop's policy objective on a Tinker-API server
# ---------------------------------------------------------------------------------------------------------

# [rl.loss] objective -> the Tinker loss with the same per-token math (trainer/serve/losses.py: ppo's clipped
# ratio, cispo's clipped stop-gradient weight), their ratio taken against the datum's `logprobs`: the sampler's.
TINKER_OBJECTIVES = {"ppo": "ppo", "cispo": "cispo"}


def token_inputs(batch: Sequence[Datum], config: Any) -> Any:
    """The batch's per-token inputs of the policy objective (kernels.objective.prepare_token_inputs over the
    datums' targets, packed one after another): its aggregation weights w_t ([rl.loss] loss_agg over the trained
    tokens) and what the mismatch metrics read. The same function the local loss builds its inputs with."""
    from kernels.objective import LossInputs, prepare_token_inputs

    def cat(key: str) -> torch.Tensor:
        return torch.cat([d.loss_inputs[key].to(torch.float32) for d in batch])

    lengths = [int(d.tokens.numel()) for d in batch]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    labels = torch.cat([d.loss_inputs["target_tokens"].to(torch.int64) for d in batch])
    inputs = LossInputs(labels=labels, advantages=cat("advantages"), mask=cat("weights"),
                        rollout_logprobs=cat("logprobs"), cu_seqlens=cu)
    tok, _ = prepare_token_inputs(inputs, config=config.loss, vocab_size=int(labels.max()) + 1)
    return tok


class TinkerPolicy:
    """The RL loop's TrainingBackend calls ("policy" = [rl.loss], [rl.optim]'s AdamW and schedule) on a Tinker-API
    server: the rollouts, rewards and advantages here, the optimisation there. Mutable state: the optimiser steps
    taken (the learning-rate schedule's position).

    forward_backward(datums of trainer.backend.local.to_datums, "policy"): the loss is Tinker's `ppo` / `cispo` with
    [rl.loss]'s clip thresholds and each token's advantage times its aggregation weight (token_inputs), so the
    summed loss is the objective's aggregated one; the ratio is against the engine's log-probs (the tinker engine's
    sampler); the objective's metrics (mismatch/*, ...) come from the server's log-probs. optim_step(None):
    AdamParams from [rl.optim] at the schedule's step."""

    def __init__(self, remote: TinkerBackend, config: Any, *, step: int = 0) -> None:
        self.remote, self.config, self.step = remote, config, step

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, Any] | None = None) -> BackendFuture:
        assert loss_fn == "policy", f"loss_fn {loss_fn!r}: the RL loop's objective is 'policy' ([rl.loss])"
        lo = self.config.loss
        for i, d in enumerate(batch):
            if "logprobs" not in d.loss_inputs:
                raise ValueError(f"datum {i}: no engine log-probs: backend = \"tinker\" takes the ratio against the "
                                 f"sampler's log-probs (the \"tinker\" engine returns them)")
        tok = token_inputs(batch, self.config)
        # Tinker's losses are sums with no mask: each token's advantage carries its aggregation weight w_t (0 off
        # the mask), so the server's summed loss is the objective's aggregated one.
        scaled = (tok.advantages * tok.weight).split([int(d.tokens.numel()) for d in batch])
        datums = [Datum(d.tokens, {"target_tokens": d.loss_inputs["target_tokens"],
                                   "logprobs": d.loss_inputs["logprobs"], "advantages": a})
                  for d, a in zip(batch, scaled)]
        config = {"clip_low_threshold": 1.0 - lo.clip_low, "clip_high_threshold": 1.0 + lo.clip_high}
        fut = self.remote.forward_backward(datums, TINKER_OBJECTIVES[lo.objective], config)
        return _then(fut, lambda out: ForwardOutput(outputs=out.outputs, metrics=self._metrics(out, tok)))

    def _metrics(self, out: ForwardOutput, tok: Any) -> dict[str, float]:
        """The step's loss (the server's sum) and the objective's metrics of the server's log-probs (mismatch/* to
        the engine's, ratio and clip fractions), computed here by the objective layer (kernels.objective)."""
        from kernels.objective import policy_objective

        logp = torch.cat([o["logprobs"] for o in out.outputs]).to(torch.float32)
        _, metrics = policy_objective(torch.where(tok.keep, logp, 0.0), None, tok,
                                      self.config.loss)
        return {**{k: float(v) for k, v in metrics.items() if k != "loss"}, "loss": out.metrics["loss:sum"],
                "num_tokens": float(tok.keep.sum())}

    def optim_step(self, adam_params: AdamParams | None = None) -> BackendFuture:
        from trainer.backend.steps import warmup_cosine

        assert adam_params is None, "the RL loop's optimiser is [rl.optim]"
        opt = self.config.optim
        lr = opt.lr * warmup_cosine(self.step, warmup_steps=opt.warmup_steps, num_steps=self.config.num_steps,
                                    min_lr_ratio=opt.min_lr_ratio)
        self.step += 1
        params = AdamParams(learning_rate=lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                            weight_decay=opt.weight_decay, grad_clip_norm=opt.max_grad_norm)
        return _then(self.remote.optim_step(params), lambda m: {"grad_norm": m.get("grad_norm:mean", float("nan")),
                                                                  "lr": lr})

    def forward(self, batch: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, Any] | None = None) -> BackendFuture:
        plain = [Datum(d.tokens, {"target_tokens": d.loss_inputs["target_tokens"]}) for d in batch]
        return self.remote.forward(plain, "cross_entropy")

    def save_state(self, name: str) -> BackendFuture:
        return self.remote.save_state(name)

    def load_state(self, path: str, optimizer: bool = True) -> BackendFuture:
        return self.remote.load_state(path, optimizer)

    def get_weights(self) -> BackendFuture:
        return self.remote.get_weights()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> BackendFuture:
        return self.remote.load_weights(weights)


class TinkerSync:
    """The weight "sync" of a run on a Tinker-API server (trainer.weight_sync.WeightSync's calls): the server saves
    its weights for sampling and the tinker engines switch to that SamplingClient, versioned. No tensor moves here.
    Mutable state: the version the engines sample."""

    def __init__(self, remote: TinkerBackend, engines: Sequence[Any]) -> None:
        from engines.tinker import TinkerEngine

        for e in engines:
            if not isinstance(e, TinkerEngine):
                raise ValueError(f"engine {e.url}: [trainer] backend = \"tinker\" samples from the server's weights: "
                                 f"every engine must be of kind \"tinker\" ([engines] fleet = [{{kind = \"tinker\", "
                                 f"url = <the server's base_url>}}])")
        self.remote, self.engines = remote, list(engines)
        self.weight_version, self.last_sync_s, self.last_sync_bytes = 0, float("nan"), 0

    def init_group(self) -> None:
        """Nothing to connect: the engines reach the server through the SDK."""

    def sync(self, weight_version: int | None = None, on_bucket: Any = None) -> int:
        import time

        t0 = time.perf_counter()
        version = self.weight_version + 1 if weight_version is None else weight_version
        sampler = self.remote.sampling_client()
        for e in self.engines:
            e.use_sampler(sampler, version)
        self.weight_version, self.last_sync_s = version, time.perf_counter() - t0
        return version

    def close(self) -> None:
        """The end of the run's syncs is the end of its session on the server (TinkerBackend.close)."""
        self.remote.close()


# ---------------------------------------------------------------------------------------------------------
# Checkpoints of a remote run, and connecting
# ---------------------------------------------------------------------------------------------------------

REMOTE_CHECKPOINTS = "remote_checkpoints.jsonl"  # under the phase's output_dir: one line per saved step


@dataclasses.dataclass(frozen=True)
class RemoteCheckpointer(Checkpointer):
    """Checkpointer's schedule (every save_every steps, at the end, on Ctrl-C) for a run whose weights live on a
    Tinker-API server: the server saves the adapter and its optimizer state (save_state), and
    <output_dir>/remote_checkpoints.jsonl gets a line with the server's tinker:// path, the TrainingState and the
    loop's resume data (data position, rollout state). `components` is None."""

    backend: Any = None  # TinkerPolicy
    output_dir: str = ""

    def save(self) -> None:
        state = self.state()
        path = self.backend.save_state(f"step_{state.step:08d}").result()
        line = {"path": path, "state": dataclasses.asdict(state), "extra": self.extra()}
        folder = Path(self.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / REMOTE_CHECKPOINTS, "a") as f:
            f.write(json.dumps(line) + "\n")


def remote_resume(backend: Any, output_dir: str, resumable: Mapping[str, Any]) -> TrainingState:
    """The newest remote checkpoint of `output_dir` loaded: the server's weights and optimizer state (load_state),
    the objects that resume with them, the schedule's step; a fresh TrainingState when there is none."""
    index = Path(output_dir) / REMOTE_CHECKPOINTS
    lines = index.read_text().splitlines() if index.is_file() else []
    if not lines:
        return TrainingState()
    last = json.loads(lines[-1])
    backend.load_state(last["path"], optimizer=True).result()
    for name, part in resumable.items():
        part.load_state_dict(last["extra"][name])
    state = TrainingState(**last["state"])
    backend.step = state.step
    return state


def _loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect(trainer: Any, rl: Any, *, model: str) -> TinkerPolicy:
    """The RL loop's backend on the Tinker-API server of [trainer] base_url (backend = "tinker"): its key from
    [trainer] api_key or the environment's RLKERNELS_API_KEY (required unless the server is on loopback), one LoRA
    training client of [rl.lora]'s shape on base model [trainer] base_model (default: `model`, the [model] path).
    The server is asked for its health first: an unreachable one fails here, naming the URL, before any work."""
    import os

    import httpx

    url = trainer.base_url
    key = trainer.api_key or os.environ.get("RLKERNELS_API_KEY")
    if not key and not _loopback(url):
        raise ValueError(f"[trainer] base_url = {url!r} is not on this machine: give its key as [trainer] api_key "
                         f"or in the environment variable RLKERNELS_API_KEY")
    key = key or "tml-loopback"  # a loopback server started without a key takes any
    try:
        reply = httpx.get(f"{url.rstrip('/')}/api/v1/healthz", headers={"X-API-Key": key}, timeout=10.0)
    except httpx.HTTPError as e:
        raise ConnectionError(f"[trainer] base_url = {url!r}: no Tinker-API server answers there ({e}); start one "
                              f"(python -m trainer serve --config <file>) or fix the URL") from e
    if reply.status_code == 401:
        raise ValueError(f"[trainer] base_url = {url!r} refused the key: set [trainer] api_key (or "
                         f"RLKERNELS_API_KEY) to the server's")
    lora = rl.lora
    spec = LoraSpec(rank=lora.rank, seed=rl.seed, alpha=lora.alpha, train_unembed=False)
    return TinkerPolicy(TinkerBackend(url, trainer.base_model or model, spec, api_key=key), rl)
