"""Supervised fine-tuning on chat conversations with an assistant-only loss.

The loss mask comes from span tracking over the chat template, so it works for any template (no
`{% generation %}` markers needed): for assistant turn i, the tokens between the rendering of messages[:i]
with the generation prompt and the rendering of messages[:i+1] are the assistant's, minus the template's
whitespace glue after the end-of-turn token. A conversation becomes a Sample whose "prompt" is its first
token, so every later token is a response token with loss_mask 1 exactly on assistant tokens, and SFT goes
through the same TrainingBackend as RL (trainer.backend.local.LocalBackend: Tinker-shaped datums, the same packed
micro-batches and `forward_backward`), with the token-level NLL -sum(m * logp) / N_tok (TrainerConfig.loss =
"nll").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.backend.checkpoint import Checkpointer, load_latest
from trainer.backend.heap import frozen_heap
from trainer.backend.local import LocalBackend, to_datums
from trainer.backend.steps import TrainerConfig, TrainingComponents, advanced, build_components, trainer_config_from
from trainer.config import SFTTrainingConfig
from trainer.evaluation import Evaluation
from trainer.metrics import MetricsLogger, open_logger, progress
from trainer.rollout.samples import pad_token_id
from trainer.stops import interrupts_held
from trainer.types import Sample, TrainingState

ROLES = ("system", "user", "assistant", "tool")
Conversation = Sequence[Mapping[str, str]]


def _check_messages(messages: Conversation, where: str = "messages") -> None:
    if not messages:
        raise ValueError(f"{where}: empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}[{i}]: expected a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{i}].role={m['role']!r}: expected one of {ROLES}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")


def _encode(tokenizer: Any, messages: Conversation, add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def compute_loss_mask(tokenizer: Any, messages: Conversation) -> tuple[list[int], list[int]]:
    """(token ids of the conversation, 0/1 mask that is 1 exactly on assistant tokens incl. the end-of-turn)."""
    _check_messages(messages)
    ids = _encode(tokenizer, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _encode(tokenizer, messages[:i], add_generation_prompt=True)
        through = _encode(tokenizer, messages[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(f"messages[{i}]: the chat template does not render conversation prefixes as token "
                             f"prefixes, so assistant spans cannot be tracked; use a template that does")
        start, end = len(before), len(through)
        while end > start and tokenizer.decode([ids[end - 1]]).strip() == "":
            end -= 1  # template glue (newlines) after the end-of-turn token is not the assistant's output
        mask[start:end] = [1] * (end - start)
    return ids, mask


def tokenize_conversation(tokenizer: Any, messages: Conversation, *, max_length: int) -> tuple[Sample, bool]:
    """A Sample (first token = prompt, the rest = response with the assistant mask) and whether the cut at
    max_length lost a trained token (template glue after the last end of turn is not trained on, so cutting it is
    no loss)."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length}: need at least 2 tokens (one input, one target)")
    ids, mask = compute_loss_mask(tokenizer, messages)
    truncated = any(mask[max_length:])
    ids, mask = ids[:max_length], mask[:max_length]
    return Sample(prompt="", tokens=tuple(ids), response_length=len(ids) - 1, loss_mask=tuple(mask[1:])), truncated


def _batch_indices(n: int, position: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the batch at data `position`: a fresh seeded permutation per epoch (resumable by position).
    Each epoch's permutation is drawn once per batch (a batch spans at most a few epochs), not once per sample."""
    perms: dict[int, np.ndarray] = {}
    out = []
    for p in range(position, position + batch_size):
        epoch, k = divmod(p, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(seed + epoch).permutation(n)
        out.append(int(perms[epoch][k]))
    return out


def run_sft_training(model: Any, conversations: Sequence[Conversation], config: SFTTrainingConfig, *,
                     tokenizer: Any, trainer_config: TrainerConfig | None = None,
                     logger: MetricsLogger | Callable[[int], MetricsLogger] | None = None, resume: bool = False,
                     components: TrainingComponents | None = None,
                     evaluation: Evaluation | None = None) -> tuple[TrainingComponents, TrainingState, list]:
    """collate -> forward_backward -> optim_step -> log -> checkpoint, for config.num_steps steps.

    model: a folder, an HF config or a built TrainModule (ignored when `components` is given). tokenizer: the
    model's (chat template, pad id). Writes metrics.jsonl and checkpoints under config.output_dir; `resume`
    continues from the newest complete checkpoint there. Ctrl-C writes a checkpoint before re-raising. Returns
    (components, final state, the per-step metric dicts). `evaluation` (trainer.evaluation.Evaluation, whose run
    syncs the engines to the trainer first): held-out figures at step 0, every N steps and at the last step, logged
    with the step.
    """
    tcfg = trainer_config or trainer_config_from(config)
    if tcfg.loss != "nll":
        raise ValueError(f"trainer_config.loss={tcfg.loss!r}: SFT trains with loss='nll'")
    samples = _tokenized(tokenizer, conversations, config.max_length)
    comp = components or build_components(model, tcfg)
    state, saved = load_latest(comp, tcfg.output_dir) if resume else (TrainingState(), {})
    position = int(saved.get("data_position", 0))
    ckpt = Checkpointer(comp, lambda: state, lambda: {"data_position": position}, save_every=tcfg.save_every)
    history: list[dict] = []
    backend = LocalBackend(comp, tcfg, pad_id=pad_token_id(tokenizer))
    # last before the `with` that closes it: what opening starts ([logging] profile_steps' profiler) always stops
    logger = open_logger(logger, Path(tcfg.output_dir) / "metrics.jsonl", enabled=comp.rank == 0,
                         keep_through=state.step)
    with (contextlib.closing(logger),
          progress(config.num_steps, initial=state.step, desc="sft", enabled=comp.rank == 0) as bar, ckpt,
          frozen_heap()):
        if evaluation is not None and evaluation.at_start and state.step == 0:
            logger.log(0, evaluation.run(0))
        while state.step < config.num_steps:
            idx = _batch_indices(len(samples), position, config.batch_size, config.seed)
            datums, extra = to_datums([samples[i] for i in idx], [0.0] * len(idx))
            # A Ctrl-C / SIGTERM during the step waits for its row to be logged (trainer.stops.interrupts_held): the
            # checkpoint on the way out then holds the whole step, and the log its row.
            with interrupts_held():
                with torch.profiler.record_function("sft.train"):  # a range in [logging] profile_steps' traces
                    fut, opt_fut = backend.forward_backward(datums, "nll", extra), backend.optim_step()
                    metrics = {**fut.result().metrics, **opt_fut.result()}
                position += config.batch_size
                state = advanced(state, int(metrics["num_tokens"]))
                if evaluation is not None and evaluation.due(state.step, config.num_steps):
                    metrics.update(evaluation.run(state.step))
                logger.log(state.step, metrics)
            history.append(metrics)
            bar.step(metrics)
            ckpt.maybe_save()
    return comp, state, history


def _tokenized(tokenizer: Any, conversations: Sequence[Conversation], max_length: int) -> list[Sample]:
    """Every conversation as a Sample (already tokenized ones, e.g. plain prompt+completion from trainer.cli, pass
    through); a warning counts the ones truncated to max_length."""
    samples, n_trunc = [], 0
    for i, conv in enumerate(conversations):
        if isinstance(conv, Sample):
            if len(conv.tokens) > max_length:
                raise ValueError(f"conversations[{i}]: {len(conv.tokens)} tokens > max_length={max_length}")
            samples.append(conv)
            continue
        _check_messages(conv, f"conversations[{i}]")
        s, cut = tokenize_conversation(tokenizer, conv, max_length=max_length)
        samples.append(s)
        n_trunc += cut
    if n_trunc:
        warnings.warn(f"{n_trunc} of {len(samples)} conversations lose trained (assistant) tokens to "
                      f"max_length={max_length}; raise [sft] max_length to train on them whole", stacklevel=3)
    return samples
