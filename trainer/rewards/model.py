"""Rewards from a learned reward model: a Hugging Face sequence-classification folder with one output.

    model, tokenizer = load_reward_model("path/to/rm", device="cuda")
    scores = score_samples(model, tokenizer, prompts, completions)        # one float per (prompt, completion)
    scorer = RewardModelScorer.from_pretrained("path/to/rm")               # what the RL loop holds
    rewards = scorer(samples)                                              # trainer.types.Sample -> float

What is scored: each (prompt, completion) rendered as a user turn and an assistant turn by the reward model's own
chat template (a system turn first when one is given: a sample's metadata["system_prompt"]), the way reward models
are trained (TRL's RewardTrainer, Skywork, ArmoRM); `chat=False` scores the plain text prompt + completion instead
(with the tokenizer's own special tokens), for reward models trained on raw text. The response's end-of-turn and
other special markers are cut first (the template writes its own).

How a batch is read: transformers' sequence classifiers take the logit of the rightmost token that is not
`config.pad_token_id`. Rows are padded on the right with that id, so every real token keeps the position it has
alone (no position shift, as left padding would give models that derive positions from the arange), causal
attention keeps padding out of the real tokens, and the score is read at the same token as in an unpadded forward
of the sample alone. A folder whose config has no pad_token_id gets the tokenizer's pad (else eos) id, with a
warning. Samples are sorted by length into batches (less padding); the scores come back in the input order.

Scoring is synchronous torch work; the loop runs it between generation and training, or in a worker thread
(trio.to_thread) to overlap generation.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.rewards.rules import _clean as strip_special_markers
from trainer.types import Sample


def load_reward_model(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a reward-model folder: an AutoModelForSequenceClassification with num_labels == 1, in
    eval mode on `device`, and the folder's tokenizer (engines.tokenizer.load_tokenizer: exactly its tokenizer.json).

    dtype None: float32 on CPU, bfloat16 on CUDA (as the engines load models). A folder that holds another kind of
    model (a causal LM, whose classification head transformers would initialise at random) or a classifier with
    several outputs is refused with an error naming the folder.
    """
    from transformers import AutoModelForSequenceClassification

    from engines.tokenizer import load_tokenizer

    folder = Path(path)
    check_reward_model_folder(folder)
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    tokenizer = load_tokenizer(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(device).eval()
    text_config = model.config.get_text_config()
    if text_config.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"reward model {str(folder)!r}: neither its config nor its tokenizer names a pad or eos "
                             f"token, so a batch's scores cannot be located; set pad_token_id in its config.json")
        warnings.warn(f"reward model {str(folder)!r}: config.json has no pad_token_id; using the tokenizer's "
                      f"{'pad' if tokenizer.pad_token_id is not None else 'eos'} id {pad} to pad batches and to find "
                      f"each row's last token (set pad_token_id in config.json to choose)", stacklevel=2)
        text_config.pad_token_id = pad
        model.config.pad_token_id = pad
    return model, tokenizer


def check_reward_model_folder(path: str | os.PathLike) -> None:
    """Without loading any weight: `path` holds a sequence classifier with one output (config.json) and its tokenizer
    files; an error naming the folder and the fix otherwise (what load_reward_model refuses)."""
    from transformers import AutoConfig

    from engines.tokenizer import check_tokenizer_files

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reward model {str(folder)!r}: no config.json there; give a Hugging Face folder "
                                f"written by model.save_pretrained")
    config = AutoConfig.from_pretrained(folder)
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"reward model {str(folder)!r} holds a {archs} model, not a sequence classifier: its score "
                         f"head would be random weights; give a folder saved from an "
                         f"AutoModelForSequenceClassification (num_labels=1)")
    if config.num_labels != 1:
        raise ValueError(f"reward model {str(folder)!r} has num_labels={config.num_labels}; a reward model gives one "
                         f"score per sequence: train or save it with num_labels=1")
    check_tokenizer_files(folder)


def encode_for_scoring(tokenizer: Any, prompt: str, completion: str, *, system: str | None = None,
                       chat: bool = True) -> list[int]:
    """The token ids a reward model scores for one sample: the conversation [system], user: prompt, assistant:
    completion in the tokenizer's chat template (`chat`), or the text prompt + completion with the tokenizer's own
    special tokens."""
    if not chat:
        return list(tokenizer(prompt + completion)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the reward model's tokenizer ({type(tokenizer).__name__}, "
                         f"{getattr(tokenizer, 'name_or_path', '')!r}) has no chat template; save one with the "
                         f"model (tokenizer.chat_template), or score plain text with chat=False")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _systems(system: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if system is None or isinstance(system, str):
        return [system] * n
    systems = list(system)
    if len(systems) != n:
        raise ValueError(f"system has {len(systems)} entries for {n} samples; give one per sample, or one string")
    return systems


def score_samples(model: Any, tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], *,
                  batch_size: int = 16, system: str | Sequence[str | None] | None = None,
                  max_length: int | None = None, chat: bool = True) -> list[float]:
    """One float per (prompt, completion), in the input order: the reward model's score of each, rendered by
    `encode_for_scoring` (module docstring), in right-padded batches of up to `batch_size` samples sorted by length.

    system: one system prompt for all, or one per sample (None entries: no system turn). max_length: a rendering
    longer than this keeps its last max_length tokens (the score is read at the end of the answer, so the start of
    the prompt goes), with a warning; None keeps every token.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; give one completion per prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length} must be >= 1, or None")
    if model.training:
        raise ValueError("the reward model is in training mode (dropout would make scores random); call model.eval()")
    pad = model.config.get_text_config().pad_token_id
    if pad is None:
        raise ValueError("the reward model's config has no pad_token_id, so a padded batch's scores cannot be "
                         "located; load it with load_reward_model (which sets one) or set model.config.pad_token_id")
    systems = _systems(system, len(prompts))
    encoded = [encode_for_scoring(tokenizer, p, c, system=s, chat=chat)
               for p, c, s in zip(prompts, completions, systems)]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"sample {empty[0]} renders to no tokens (prompt {prompts[empty[0]][:60]!r}); nothing to "
                         f"score")
    if max_length is not None:
        cut = sum(len(ids) > max_length for ids in encoded)
        if cut:
            warnings.warn(f"{cut} of {len(encoded)} samples are longer than max_length={max_length} tokens; their "
                          f"first tokens were cut before scoring", stacklevel=2)
            encoded = [ids[-max_length:] for ids in encoded]
    device = next(model.parameters()).device
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]), reverse=True)
    scores: list[float] = [0.0] * len(encoded)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = len(encoded[rows[0]])  # sorted longest first
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):  # right padding: real tokens keep positions 0 .. len-1
                input_ids[j, :len(encoded[i])] = torch.tensor(encoded[i])
                attention_mask[j, :len(encoded[i])] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits  # [b, 1]
            if logits.dim() != 2 or logits.shape[-1] != 1:
                raise ValueError(f"the reward model returned logits of shape {tuple(logits.shape)}; a reward model "
                                 f"needs num_labels=1 (one score per sequence)")
            for i, value in zip(rows, logits[:, 0].float().tolist()):
                scores[i] = value
    return scores


class RewardModelScorer:
    """A loaded reward model that scores finished samples: `scorer(samples) -> list[float]` (input order).

    Each sample is scored on sample.prompt and sample.response (special markers cut), with
    sample.metadata["system_prompt"] as the system turn when it is there."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16, chat: bool = True,
                 max_length: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.chat, self.max_length = batch_size, chat, max_length

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, **kwargs: Any) -> RewardModelScorer:
        """`load_reward_model(path, device=, dtype=)`; kwargs: batch_size, chat, max_length."""
        model, tokenizer = load_reward_model(path, device=device, dtype=dtype)
        return cls(model, tokenizer, **kwargs)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return score_samples(self.model, self.tokenizer, [s.prompt for s in samples],
                             [strip_special_markers(s.response) for s in samples], batch_size=self.batch_size,
                             system=[s.metadata.get("system_prompt") for s in samples],
                             max_length=self.max_length, chat=self.chat)
