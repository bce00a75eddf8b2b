"""The TrainingBackend surface (issue 38 item 6, seed 004): Tinker's shape, in process.

    backend.forward(batch)                                  -> Future[ForwardOutput]   (no gradient)
    backend.forward_backward(batch, loss_fn, loss_fn_config) -> Future[ForwardOutput]  (gradients accumulate)
    backend.optim_step(adam_params)                          -> Future[dict]            (AdamW on the adapter)
    backend.save_state(name) / load_state(path, optimizer)   -> Future[str] / Future[None]
    backend.get_weights() / load_weights(weights)            -> Future[dict[str, Tensor]] / Future[None]

A batch is a list of `Datum` (Tinker's: input tokens [T] and per-token loss inputs [T]: target_tokens, weights,
advantages, logprobs). Every call returns at once with a `BackendFuture` (blocking `.result()`, `await` from trio
or asyncio); the work runs on one worker thread per base model, in submission order, so a caller may queue
forward_backward and optim_step back to back and await both later.

`LoraBase` is one frozen Hugging Face model in this process; each `LocalLoraBackend` is one LoRA adapter on it
(PEFT's, under its own adapter name), so several training clients share the base weights. Requests of different
adapters are not batched into one forward: each runs its own pass with its adapter active (the datums of one
request are one padded forward). train_unembed is a LoRA on the lm_head, folded into the fused log-prob kernel
by widening its operands: logits = [h, s h A^T] @ [W, B]^T, so the [T, V] logits still never exist.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kernels.linear_logprobs import linear_token_logprobs
from trainer.backend.lora import lora_layers, seeded_lora_a

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Datum:
    """One sequence: tokens [T] (int64, the model input) and loss inputs, each [T] (target_tokens int64; weights,
    advantages, logprobs float32; position t scores target_tokens[t] after tokens[: t + 1])."""

    tokens: torch.Tensor
    loss_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardOutput:
    """Per datum the target log-probs [T] (float32) and the loss's other per-token outputs; batch metrics."""

    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams (its defaults). grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class LoraSpec:
    """A training client's adapter: Tinker's LoraConfig (rank, seed, which parts) and PEFT's alpha."""

    rank: int = 32
    seed: int = 0
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        assert self.rank > 0, f"LoRA rank={self.rank}: must be > 0"
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("LoRA: at least one of train_attn, train_mlp, train_unembed must be true")


class BackendFuture:
    """The result of queued backend work: `.result(timeout)` blocks, `await fut` waits from trio or asyncio."""

    def __init__(self, fut: concurrent.futures.Future) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Any:
        return self._fut.result(timeout)

    async def aresult(self) -> Any:
        """The result, awaited from trio or asyncio; a cancelled trio wait leaves the queued work to run."""
        from engines.local import wait_future

        return await wait_future(self._fut, cancel=False)

    def __await__(self) -> Generator[Any, None, Any]:
        return self.aresult().__await__()


class TrainingBackend(Protocol):
    """What a loop (or the Tinker service) calls; every method returns a BackendFuture, run in submission order."""

    def forward(self, batch: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture: ...

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture: ...

    def optim_step(self, adam_params: AdamParams) -> BackendFuture: ...

    def save_state(self, name: str) -> BackendFuture: ...

    def load_state(self, path: str, optimizer: bool = True) -> BackendFuture: ...

    def get_weights(self) -> BackendFuture: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> BackendFuture: ...


# ---------------------------------------------------------------------------------------------------------
# The shared base model
# ---------------------------------------------------------------------------------------------------------


class LoraBase:
    """One frozen HF causal LM and the worker thread every adapter's work runs on (submission order, one device).

    Mutable state: the model (adapters are added and removed by name) and the queue."""

    def __init__(self, path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 chunk_tokens: int | None = None) -> None:
        """chunk_tokens: tokens per lm_head chunk of the fused log-probs ([trainer] logprob_chunk_tokens; None:
        auto)."""
        from transformers import AutoModelForCausalLM

        self.path = str(path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(device)
        self.model.requires_grad_(False)
        self.model.eval()  # dropout off: the same batch gives the same gradients
        self.device = torch.device(device)
        self.chunk_tokens = chunk_tokens
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-base")
        self.adapters: dict[str, LoraSpec] = {}

    def submit(self, fn: Callable[[], Any]) -> BackendFuture:
        """Queue `fn` behind everything submitted before (any adapter's); its exception is the future's."""
        return BackendFuture(self._worker.submit(fn))

    def close(self, cancel: bool = True, wait: bool = True) -> None:
        """Stop the worker: queued work not started is cancelled (its futures raise CancelledError); wait: until the
        running one has finished."""
        self._worker.shutdown(wait=wait, cancel_futures=cancel)

    def add_adapter(self, name: str, spec: LoraSpec) -> None:
        """A fresh adapter `name` (PEFT's Kaiming-uniform A from the spec's seed, B = 0: the base's outputs)."""
        import peft

        assert name not in self.adapters, f"adapter {name!r} exists"
        targets = (ATTN if spec.train_attn else ()) + (MLP if spec.train_mlp else ())
        have = {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules()
                if isinstance(m, nn.Linear | _lora_layer_type())}  # an adapted Linear is PEFT's layer now
        targets = tuple(t for t in targets if t in have)
        pattern = r"model\.layers\.\d+\.(?:.*\.)?(?:" + "|".join(targets) + ")" if targets else None
        if spec.train_unembed:
            pattern = f"(?:{pattern})|lm_head" if pattern else "lm_head"
        config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=pattern, bias="none",
                                 lora_dropout=0.0)
        # PEFT keeps the last injection's config on the model and, finding one, would read the new adapter's
        # targets from it (its defaults, q/v only): each adapter is injected with its own config alone.
        self.model.__dict__.pop("peft_config", None)
        peft.inject_adapter_in_model(config, self.model, adapter_name=name)
        self._adapters_trainable()  # PEFT's injection unfreezes only the newest adapter
        for path, layer in lora_layers(self.model).items():
            if name not in layer.lora_A:
                continue
            a = layer.lora_A[name].weight
            with torch.no_grad():
                a.copy_(seeded_lora_a(a.shape, spec.seed, path))
                layer.lora_B[name].weight.zero_()
        self.adapters[name] = spec

    def remove_adapter(self, name: str) -> None:
        for layer in lora_layers(self.model).values():
            if name in layer.lora_A:
                layer.delete_adapter(name)
        # PEFT's delete_adapter, where it removes a layer's active adapter, activates another one there and freezes
        # every other adapter of the layer: each op activates its own (`activate`), and all stay trainable
        self._adapters_trainable()
        self.adapters.pop(name, None)

    def _adapters_trainable(self) -> None:
        """Every adapter's A and B take gradients, nothing else does (the base stays frozen)."""
        for n, p in self.model.named_parameters():
            p.requires_grad_(".lora_A." in n or ".lora_B." in n)

    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """{"<module path>.lora_A.weight" | ".lora_B.weight": parameter} of adapter `name` (PEFT's saved names)."""
        out = {}
        for path, layer in lora_layers(self.model).items():
            if name in layer.lora_A:
                out[f"{path}.lora_A.weight"] = layer.lora_A[name].weight
                out[f"{path}.lora_B.weight"] = layer.lora_B[name].weight
        return out

    def activate(self, name: str) -> None:
        """Only adapter `name` takes part in the forward (and gets gradients)."""
        for layer in lora_layers(self.model).values():
            layer._active_adapter = [name] if name in layer.lora_A else []

    def token_logprobs(self, name: str, batch: Sequence[Datum]) -> list[torch.Tensor]:
        """log pi(target_tokens[t] | tokens[: t + 1]) [T] per datum under adapter `name`, float32, with autograd.

        One right-padded forward of the batch (causal attention: padding after a row never reaches it); the
        log-probs through the fused kernel from hidden states (kernels/linear_logprobs.py)."""
        self.activate(name)
        lengths = [int(d.tokens.numel()) for d in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, d in enumerate(batch):
            ids[i, : lengths[i]] = d.tokens
            mask[i, : lengths[i]] = 1
        hidden = self.model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
        rows = hidden[mask.bool()]  # [N, H], the rows of every datum in order
        labels = torch.cat([d.loss_inputs["target_tokens"].to(self.device, torch.long) for d in batch])
        head = self.model.get_output_embeddings()
        lora_head = isinstance(head, _lora_layer_type())
        weight = head.base_layer.weight if lora_head else head.weight
        if lora_head and name in head.lora_A:  # train_unembed: h W^T + s (h A^T) B^T = [h, s h A^T] @ [W, B]^T
            a, b, s = head.lora_A[name].weight, head.lora_B[name].weight, head.scaling[name]
            rows, weight = torch.cat([rows, s * rows @ a.t()], dim=1), torch.cat([weight, b], dim=1)
        logp = linear_token_logprobs(rows, weight, labels, chunk_tokens=self.chunk_tokens)  # [N] float32
        return list(logp.split(lengths))


    @torch.no_grad()
    def score(self, tokens: torch.Tensor, spec: LoraSpec | None = None,
              weights: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """log pi(tokens[t + 1] | tokens[: t + 1]) [T - 1] under the base, or the base with the adapter `weights`
        (PEFT's saved names, of the structure `spec`): a sampler's prompt log-probs. Run it on the worker (submit).

        The weights go into a scoring adapter of that structure (one per structure, made at its first use), so a
        sampler scores with its own snapshot whatever its training client has done since."""
        datum = Datum(tokens[:-1], {"target_tokens": tokens[1:]})
        if weights is None:
            return self.token_logprobs("", [datum])[0]
        name = f"score_r{spec.rank}_{int(spec.train_attn)}{int(spec.train_mlp)}{int(spec.train_unembed)}"
        if name not in self.adapters:
            self.add_adapter(name, spec)
        params = self.adapter_params(name)
        if set(params) != set(weights):
            raise ValueError(f"sampler weights do not match a rank-{spec.rank} adapter of this model")
        for k, p in params.items():
            p.copy_(weights[k])
        return self.token_logprobs(name, [datum])[0]


def _lora_layer_type() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


# ---------------------------------------------------------------------------------------------------------
# One adapter = one training client
# ---------------------------------------------------------------------------------------------------------


class LocalLoraBackend:
    """TrainingBackend of one LoRA adapter on a shared LoraBase. Mutable state: the adapter and its optimizer.

    loss_fns: {name: fn(logp [T], loss inputs, config) -> (loss scalar, {output name: [T]})} for one datum
    (trainer/serve/losses.py holds Tinker's); the batch's loss is their sum, as Tinker's."""

    def __init__(self, base: LoraBase, name: str, spec: LoraSpec, loss_fns: Mapping[str, Callable],
                 checkpoint_dir: str | os.PathLike) -> None:
        self.base, self.name, self.spec, self.loss_fns = base, name, spec, loss_fns
        self.checkpoint_dir = Path(checkpoint_dir)
        self.steps = 0
        def add() -> dict[str, nn.Parameter]:  # on the base's worker: another client's injection changes the layers
            base.add_adapter(name, spec)
            return base.adapter_params(name)
        self.params = base.submit(add).result()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4, foreach=False)

    # -- surface ---------------------------------------------------------------------------------------
    def forward(self, batch: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture:
        self._check(batch, loss_fn)
        return self.base.submit(lambda: self._run(batch, loss_fn, dict(loss_fn_config or {}), backward=False))

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> BackendFuture:
        self._check(batch, loss_fn)
        return self.base.submit(lambda: self._run(batch, loss_fn, dict(loss_fn_config or {}), backward=True))

    def optim_step(self, adam_params: AdamParams) -> BackendFuture:
        return self.base.submit(lambda: self._optim_step(adam_params))

    def save_state(self, name: str) -> BackendFuture:
        return self.base.submit(lambda: self._save(name, optimizer=True))

    def save_weights(self, name: str) -> BackendFuture:
        """The adapter alone (a sampler checkpoint): a PEFT folder."""
        return self.base.submit(lambda: self._save(name, optimizer=False))

    def load_state(self, path: str, optimizer: bool = True) -> BackendFuture:
        return self.base.submit(lambda: self._load(path, optimizer))

    def get_weights(self) -> BackendFuture:
        return self.base.submit(lambda: {k: p.detach().clone() for k, p in self.params.items()})

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> BackendFuture:
        return self.base.submit(lambda: self._copy_in(weights))

    def close(self) -> BackendFuture:
        return self.base.submit(lambda: self.base.remove_adapter(self.name))

    # -- work (on the base's worker thread) -------------------------------------------------------------
    def _check(self, batch: Sequence[Datum], loss_fn: str) -> None:
        """Bad input is refused when it is submitted (a clear error, never a queued failure). The token ids are
        range-checked over the whole batch at once (a few tensor ops, not a few per datum: this runs on the caller's
        thread, the server's event loop for the Tinker service); the datum is looked for only when one is bad."""
        if loss_fn not in self.loss_fns:
            raise ValueError(f"unknown loss_fn {loss_fn!r}: use one of {sorted(self.loss_fns)}")
        if not batch:
            raise ValueError("empty batch: forward_backward needs at least one datum")
        for i, d in enumerate(batch):
            n = int(d.tokens.numel())
            if n == 0:
                raise ValueError(f"datum {i}: no input tokens")
            if "target_tokens" not in d.loss_inputs:
                raise ValueError(f"datum {i}: loss_fn_inputs lacks 'target_tokens' (one target per input token)")
            for key, t in d.loss_inputs.items():
                if t.numel() != n:
                    raise ValueError(f"datum {i}: loss_fn_inputs[{key!r}] has {t.numel()} values for {n} input "
                                     f"tokens: give one per input token")
            if self.base.max_positions is not None and n > self.base.max_positions:
                raise ValueError(f"datum {i}: {n} tokens exceed the model's context of {self.base.max_positions}")
        for key in ("model_input", "target_tokens"):
            ids = [d.tokens if key == "model_input" else d.loss_inputs[key] for d in batch]
            flat = torch.cat([t.reshape(-1) for t in ids])
            if not ((flat < 0) | (flat >= self.base.vocab_size)).any():
                continue
            for i, t in enumerate(ids):
                bad = (t < 0) | (t >= self.base.vocab_size)
                if bad.any():
                    raise ValueError(f"datum {i}: {key} has token id {int(t[bad][0])} outside the vocabulary "
                                     f"[0, {self.base.vocab_size})")

    def _run(self, batch: Sequence[Datum], loss_fn: str, config: dict, *, backward: bool) -> ForwardOutput:
        fn = self.loss_fns[loss_fn]
        with torch.set_grad_enabled(backward):
            logps = self.base.token_logprobs(self.name, batch)
            total, outputs = None, []
            for d, logp in zip(batch, logps):
                inputs = {k: v.to(self.base.device, torch.float32) for k, v in d.loss_inputs.items()
                          if k != "target_tokens"}
                loss, extra = fn(logp, inputs, config)
                total = loss if total is None else total + loss
                outputs.append({"logprobs": logp.detach().float().cpu(),
                                **{k: v.detach().float().cpu() for k, v in extra.items()}})
            if backward:
                total.backward()
        return ForwardOutput(outputs=outputs, metrics={"loss:sum": float(total.detach())})

    def _optim_step(self, p: AdamParams) -> dict[str, float]:
        params = list(self.params.values())
        for group in self.optimizer.param_groups:
            group.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        grads = [q.grad for q in params if q.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads \
            else torch.zeros(())
        if p.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, p.grad_clip_norm, foreach=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": float(norm), "learning_rate:mean": p.learning_rate}

    def _save(self, name: str, *, optimizer: bool) -> str:
        """<checkpoint_dir>/<name>/: adapter_model.safetensors + adapter_config.json (PEFT's), and with optimizer
        optimizer.safetensors (AdamW's exp_avg / exp_avg_sq / step per adapter tensor)."""
        import json

        from safetensors.torch import save_file

        folder = self.checkpoint_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file({f"base_model.model.{k}": p.detach().cpu().contiguous() for k, p in self.params.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(self.adapter_config(), indent=1))
        if optimizer:
            state = {}
            for k, p in self.params.items():
                for field_name, t in self.optimizer.state.get(p, {}).items():
                    state[f"{k}/{field_name}"] = t.detach().cpu().reshape(t.shape).contiguous()
            save_file(state, str(folder / "optimizer.safetensors"), metadata={"steps": str(self.steps)})
        return str(folder)

    def adapter_config(self) -> dict:
        targets = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in self.params})
        return {"peft_type": "LORA", "base_model_name_or_path": self.base.path, "r": self.spec.rank,
                "lora_alpha": self.spec.alpha, "target_modules": targets, "bias": "none", "lora_dropout": 0.0,
                "task_type": "CAUSAL_LM"}

    def _load(self, path: str, optimizer: bool) -> None:
        """The adapter (and with `optimizer` AdamW's state and the step count; without, a fresh AdamW from step 0)
        from a checkpoint folder. Every file is read and checked before anything changes: a failed load leaves the
        client as it was."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        folder = Path(path)
        if not (folder / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(f"{folder}: no adapter_model.safetensors (not a checkpoint of this server)")
        opt = folder / "optimizer.safetensors"
        if optimizer and not opt.is_file():
            raise FileNotFoundError(f"{folder}: no optimizer state (a sampler checkpoint); load it without optimizer")
        weights = {k.removeprefix("base_model.model."): v
                   for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
        state, steps = {}, 0
        if optimizer:
            state = load_file(str(opt))
            with safe_open(str(opt), "pt") as f:
                steps = int((f.metadata() or {}).get("steps", 0))
        self._copy_in(weights)  # checks every name and shape before it copies
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4, foreach=False)
        for k, p in self.params.items():
            fields = {f.split("/", 1)[1]: t for f, t in state.items() if f.split("/", 1)[0] == k}
            if fields:
                self.optimizer.state[p] = {f: t.to(p.device) if f != "step" else t for f, t in fields.items()}
        self.steps = steps

    @torch.no_grad()
    def _copy_in(self, weights: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.params) - set(weights))
        extra = sorted(set(weights) - set(self.params))
        if missing or extra:
            raise ValueError(f"adapter weights do not match this client's LoRA (rank {self.spec.rank}): missing "
                             f"{missing[:3]}, unexpected {extra[:3]}")
        for k, p in self.params.items():
            if weights[k].shape != p.shape:
                raise ValueError(f"adapter weight {k}: shape {tuple(weights[k].shape)}, expected {tuple(p.shape)}")
        for k, p in self.params.items():
            p.copy_(weights[k])

    def scaling(self) -> float:
        return self.spec.alpha / self.spec.rank
