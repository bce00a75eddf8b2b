"""TinkerBackend: the TrainingBackend surface (trainer/backend/protocol.py) over any Tinker-API server.

The same calls as LocalLoraBackend, the optimisation on the server (this project's `python -m trainer serve`, or
any other server of the API) through the official `tinker` SDK: a loop written against TrainingBackend swaps one
for the other. What the API does not offer: `get_weights` / `load_weights` (a Tinker server neither sends nor
takes raw weights: sample with `sampling_client()`, move weights with save_state / load_state).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainer.backend.protocol import AdamParams, BackendFuture, Datum, ForwardOutput, LoraSpec


def _then(api_future: Any, fn: Callable[[Any], Any]) -> BackendFuture:
    """A BackendFuture of fn(the SDK future's result)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(src: concurrent.futures.Future) -> None:
        try:
            out.set_result(fn(src.result()))
        except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
            out.set_exception(e)

    api_future.future().add_done_callback(done)
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
