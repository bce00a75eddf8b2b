"""Pure rollout functions: group filters, sample transforms, batch conversion and batch statistics.

The stateful part (engine requests, over-sampling, aborts, the partial-sample cache) and the plain generator a
training loop iterates over live in `trainer.rollout.manager`, which imports this module (never the reverse).

Dynamic filters take one group (the n samples of one prompt, rewards filled in) and return True to keep it.
`RolloutConfig.dynamic_filters` names them; a name is a key of `FILTERS` or "module:function".
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.openai_wire import end_of_turn_ids  # the chat template's end-of-turn token (engines/ use it too)
from trainer.rollout.loading import load_callable
from trainer.types import RolloutBatch, Sample, Status

GroupFilter = Callable[[Sequence[Sample]], bool]
SampleTransform = Callable[[list[Sample]], list[Sample]]


# ----------------------------------------------------------------------------------------------- filters
def _rewards(group: Sequence[Sample]) -> list[float]:
    return [0.0 if s.reward is None else float(s.reward) for s in group]


def check_reward_nonzero_std(group: Sequence[Sample], *, eps: float = 1e-6) -> bool:
    """Keep groups whose rewards differ: with equal rewards every GRPO advantage is 0 and the group
    contributes no gradient (DAPO's dynamic sampling)."""
    r = _rewards(group)
    return len(r) > 1 and statistics.pstdev(r) > eps


def check_min_reward(group: Sequence[Sample], *, min_reward: float = 0.0) -> bool:
    """Keep groups whose mean reward is at least `min_reward` (drops groups of penalised/failed samples)."""
    r = _rewards(group)
    return bool(r) and sum(r) / len(r) >= min_reward


def check_response_diversity(group: Sequence[Sample], *, min_unique_fraction: float = 0.5) -> bool:
    """Keep groups in which at least `min_unique_fraction` of the responses are distinct token sequences
    (and at least two are), so the group is not a collapse onto one answer."""
    if len(group) < 2:
        return True
    unique = len({s.tokens[s.prompt_length:] for s in group})
    return unique >= 2 and unique / len(group) >= min_unique_fraction


def check_reasonable_length(group: Sequence[Sample], *, max_truncated_fraction: float = 0.5) -> bool:
    """Keep groups where no response is empty and at most `max_truncated_fraction` hit max_new_tokens."""
    if any(s.response_length == 0 for s in group):
        return False
    truncated = sum(1 for s in group if s.status == Status.TRUNCATED)
    return truncated <= max_truncated_fraction * len(group)


def check_quality_and_diversity(group: Sequence[Sample]) -> bool:
    """All three: a learning signal (reward std > 0), distinct responses, sensible lengths."""
    return check_reward_nonzero_std(group) and check_response_diversity(group) and check_reasonable_length(group)


FILTERS: dict[str, GroupFilter] = {
    "check_reward_nonzero_std": check_reward_nonzero_std,
    "check_min_reward": check_min_reward,
    "check_response_diversity": check_response_diversity,
    "check_reasonable_length": check_reasonable_length,
    "check_quality_and_diversity": check_quality_and_diversity,
}


def get_filter(name: str | GroupFilter) -> GroupFilter:
    """Resolve a filter name (a key of FILTERS or "module:function"); callables pass through."""
    if callable(name):
        return name
    if name in FILTERS:
        return FILTERS[name]
    if ":" in name:
        return load_callable(name, "dynamic_filters:")
    raise ValueError(f"dynamic_filters: unknown filter {name!r}; choose from {sorted(FILTERS)} or 'module:function'")


def resolve_filters(names: Sequence[str | GroupFilter]) -> list[tuple[str, GroupFilter]]:
    return [(n if isinstance(n, str) else getattr(n, "__name__", repr(n)), get_filter(n)) for n in names]


def first_failed_filter(group: Sequence[Sample], filters: Sequence[tuple[str, GroupFilter]]) -> str | None:
    """The name of the first filter that drops `group`, or None when the group passes all of them."""
    for name, fn in filters:
        if not fn(group):
            return name
    return None


# ----------------------------------------------------------------------------------------------- batches
def apply_sample_transforms(samples: Sequence[Sample], transforms: Sequence[SampleTransform]) -> list[Sample]:
    """Run list -> list transforms in order (e.g. drop failed samples, cap lengths, add metadata)."""
    return functools.reduce(lambda acc, t: list(t(acc)), transforms, list(samples))


def group_ids(samples: Sequence[Sample]) -> list[Any]:
    """Each sample's group (the samples of one prompt): its group_index."""
    return [s.group_index for s in samples]


def data_row(sample: Sample) -> dict[str, Any]:
    """What a user's environment (reset's metadata), rollout_fn or agent gets of a sample: its data row's fields
    ("answer", "prompt_index", ...) and its identity, "group_uid" (its group_index) and "sample_index" (its index)."""
    return {**sample.metadata, "group_uid": sample.group_index, "sample_index": sample.index}


def compute_response_lengths(samples: Sequence[Sample]) -> list[int]:
    return [s.response_length for s in samples]


def prompt_token_ids(tokenizer: Any, text: str, *, chat: bool, system: str | None = None) -> list[int]:
    """The token ids a rollout (or an evaluation) sends for a prompt: a user turn of the chat template (after a
    system turn when `system` is given) followed by the assistant header when `chat`, else the bare text without
    special tokens."""
    if chat:
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, *, chat: bool, extra: Sequence[int] = (),
                   generation_config: Any = None) -> list[int]:
    """The token ids that end a response: `extra`, the tokenizer's eos, the model's generation-config eos ids
    (an int or a list), and with `chat` the chat template's end-of-turn token (the first special token the
    template writes after an assistant message: `<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3)."""
    stops = {int(t) for t in extra}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stops.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if gen_eos is not None:
        stops.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    if chat:
        stops.update(end_of_turn_ids(tokenizer))
    return sorted(stops)


def pad_token_id(tokenizer: Any) -> int:
    """The id packed micro-batches pad with: the tokenizer's pad token, else its eos (padding is masked out of every
    loss, so any id of the vocabulary works)."""
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return int(pad)
    raise ValueError(f"tokenizer {type(tokenizer).__name__}: has neither a pad nor an eos token, so packed batches "
                     f"have nothing to pad with; set tokenizer.pad_token (e.g. to an unused special token)")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ----------------------------------------------------------------------------------------------- growing samples
def extend_sample(sample: Sample, new_ids: Sequence[int], new_logprobs: Sequence[float], *, status: Status,
                  weight_version: int | None, tokenizer: Any = None, max_new_tokens: int | None = None,
                  loss_mask_value: int | None = None, spans: Sequence[tuple[int, int]] = (),
                  cached_tokens: int = 0, spec_accepted_tokens: int = 0) -> Sample:
    """Append one segment to a (possibly partial) sample: tokens the engine generated, or (multi-turn episodes)
    tokens an environment's messages rendered to.

    `metadata["weight_versions"]` lists the (oldest) version of each generated segment (None: not generated, no
    version); `weight_version` is the oldest of them, the conservative value for the trainer's staleness bound.
    `spans` ((first token index in the segment, version), an engine's Completion.weight_versions) say which
    weights produced which of the new tokens when an update landed mid-request; `metadata["token_versions"]` keeps
    them as [response offset, version] pairs, one a run of tokens (one pair a segment when the engine gives none).
    `loss_mask_value` (1: the model's tokens, 0: the environment's) extends an explicit loss mask; None leaves it
    unset (every response token trained). `cached_tokens` (the engine's Completion.cached_tokens: prompt tokens of
    this request it took from its prefix cache, not prefilled) add up in `metadata["prefill_tokens_reused"]`, and
    `spec_accepted_tokens` (Completion.spec_accepted_tokens) in `metadata["spec_accepted_tokens"]`.
    """
    old_lp = list(sample.rollout_logprobs or ())
    tokens = tuple(sample.tokens) + tuple(new_ids)
    resp_len = sample.response_length + len(new_ids)
    versions = list(sample.metadata.get("weight_versions", ())) + (
        [weight_version] if new_ids and weight_version is not None else [])
    runs = list(sample.metadata.get("token_versions", ()))
    if new_ids and weight_version is not None:
        runs += [[sample.response_length + i, v] for i, v in (spans or ((0, weight_version),))]
    if status == Status.ABORTED and max_new_tokens is not None and resp_len >= max_new_tokens:
        status = Status.TRUNCATED
    response = sample.response
    if tokenizer is not None:
        response = tokenizer.decode(list(tokens[len(tokens) - resp_len:]), skip_special_tokens=False)
    reused = {key: sample.metadata.get(key, 0) + n for key, n in (("prefill_tokens_reused", cached_tokens),
                                                                   ("spec_accepted_tokens", spec_accepted_tokens))
              if n or key in sample.metadata}
    mask = sample.loss_mask
    if loss_mask_value is not None:
        mask = tuple(mask or ()) + (loss_mask_value,) * len(new_ids)
    return dataclasses.replace(
        sample, tokens=tokens, response=response, response_length=resp_len, loss_mask=mask,
        rollout_logprobs=tuple(old_lp) + tuple(float(x) for x in new_logprobs), status=status,
        weight_version=min(versions, default=sample.weight_version if weight_version is None else weight_version),
        metadata={**sample.metadata, "weight_versions": versions, "token_versions": runs, **reused})


# What a rollout adds to a sample's metadata as it progresses (trainer.rollout.episodes adds the episode's).
PROGRESS_KEYS = frozenset({"weight_versions", "token_versions", "turns", "tool_calls", "tool_errors", "env_seconds",
                           "env_error", "messages", "truncated_by", "reward_error", "reward_traceback",
                           "agent_seconds", "agent_splits", "agent_error", "agent_parts", "agent_part",
                           "prefill_tokens_reused", "spec_accepted_tokens"})


def restart_sample(sample: Sample) -> Sample:
    """Drop a sample's partial response (too stale to finish, or an episode whose environment is gone) and make it
    pending again."""
    prompt = tuple(sample.tokens[: sample.prompt_length])
    meta = {k: v for k, v in sample.metadata.items() if k not in PROGRESS_KEYS}
    return dataclasses.replace(sample, tokens=prompt, response="", response_length=0, rollout_logprobs=(),
                               loss_mask=None, reward=None, status=Status.PENDING, metadata=meta)


def restart_group(group: Sequence[Sample]) -> list[Sample]:
    """A whole group pending again, one sample per episode: the further training sequences of an agent episode
    that split (`agent_part`, trainer.rollout.gateway.unpack_parts) are dropped, not started as episodes of their
    own (the group would hold more than n_samples_per_prompt)."""
    return [restart_sample(s) for s in group if "agent_part" not in s.metadata]


def build_batch_metadata(samples: Sequence[Sample], *, current_weight_version: int = 0,
                         counters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Scalar statistics of a batch for logging (all plain Python numbers, JSON-serialisable)."""
    rewards = [0.0 if s.reward is None else s.reward for s in samples]
    lengths = compute_response_lengths(samples)
    meta: dict[str, Any] = {
        "num_samples": len(samples),
        "num_groups": len({s.group_index for s in samples}),
        "reward_mean": _mean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length_mean": _mean(lengths),
        "response_length_max": max(lengths, default=0),
        "truncated_fraction": _mean([float(s.status == Status.TRUNCATED) for s in samples]),
        "failed_fraction": _mean([float(s.status == Status.FAILED) for s in samples]),
        "weight_version": current_weight_version,
        # Prompt tokens the engines did not prefill (their prefix caches held them: an episode's earlier turns)
        "prefill_tokens_reused": sum(s.metadata.get("prefill_tokens_reused", 0) for s in samples),
        # The model's own tokens (loss mask 1; an episode's tool results are 0; the whole response without a mask)
        "generated_tokens": sum(sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples),
        # Generated tokens drawn as an engine's speculative draft said (each a forward saved; [engines]
        # speculative_tokens)
        "spec_accepted_tokens": sum(s.metadata.get("spec_accepted_tokens", 0) for s in samples),
    }
    episodes = [s for s in samples if "turns" in s.metadata]  # multi-turn episodes (trainer.rollout.episodes)
    if episodes:
        meta.update({
            "turns_mean": _mean([s.metadata["turns"] for s in episodes]),
            "tool_calls_mean": _mean([s.metadata["tool_calls"] for s in episodes]),
            "tool_errors": sum(s.metadata["tool_errors"] for s in episodes),
            "env_errors": sum("env_error" in s.metadata for s in episodes),
            "env_timeouts": sum(bool(s.metadata.get("env_timed_out")) for s in episodes),  # of env_errors
            "env_time_s": sum(s.metadata["env_seconds"] for s in episodes),
        })
    agents = [s for s in samples if "agent_seconds" in s.metadata]  # agent episodes (trainer.rollout.gateway)
    if agents:
        meta.update({
            "agent_splits": sum(s.metadata["agent_splits"] for s in agents),  # sequences beyond one per episode
            "agent_errors": sum("agent_error" in s.metadata for s in agents),
            "agent_time_s": sum(s.metadata["agent_seconds"] for s in agents),
        })
    for k, v in (counters or {}).items():
        meta[k] = v
    return meta


def convert_to_batch(groups: Sequence[Sequence[Sample]], *, current_weight_version: int = 0,
                     counters: Mapping[str, Any] | None = None) -> RolloutBatch:
    """Flatten accepted groups into a batch (each sample keeps its identity: group_index and index)."""
    samples = [s for group in groups for s in group]
    return RolloutBatch(samples=tuple(samples),
                        metadata=build_batch_metadata(samples, current_weight_version=current_weight_version,
                                                      counters=counters))


def sample_to_dict(s: Sample) -> dict[str, Any]:
    """A JSON-friendly dict of a sample (checkpoints of the partial-sample cache)."""
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(Sample)}
    d.update(tokens=list(s.tokens), status=s.status.value, metadata=dict(s.metadata),
             loss_mask=None if s.loss_mask is None else list(s.loss_mask),
             rollout_logprobs=None if s.rollout_logprobs is None else list(s.rollout_logprobs))
    return d


def sample_from_dict(d: Mapping[str, Any]) -> Sample:
    return Sample(**d)
