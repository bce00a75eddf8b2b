"""Packed micro-batches: what `forward_backward` / `compute_logprobs` consume.

A sample is `tokens = prompt + response` (length L, prompt length P, response length R = L - P). Position j
of the packed row predicts token j+1 of the same sequence, so within one sample

    labels[j]    = tokens[j+1]                    for P-1 <= j <= L-2 (the response tokens), else -100
    loss_mask[j] = sample.loss_mask[j+1-P]        on those positions, else 0
    advantages[j]= the sample's advantage         (broadcast; only read where loss_mask = 1)
    *_logprobs[j]= per-response-token value [j+1-P] (old / ref / rollout log-probs), else 0

The planner (trainer/batching/planner.py) assigns samples to ranks and micro-batches under a token budget; every row is
padded to a multiple of `bucket_size` (a small set of shapes, so torch.compile recompiles at most once per
bucket). Ranks with fewer micro-batches get empty ones (all padding, mask 0) so that every rank runs the same
number of FSDP forwards. `num_tokens` / `num_seqs` are GLOBAL (all micro-batches of all ranks): the loss of
each micro-batch is already divided by them, so summing over micro-batches and ranks gives the exact loss.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from kernels.objective import IGNORE_INDEX, LossInputs
from kernels.packing import PackedBatch, broadcast_to_tokens, packed_layout, shift_left
from trainer.batching.planner import plan_micro_batches
from trainer.types import Sample


def _move(obj, fn):
    """dataclasses.replace(obj, every tensor field -> fn(tensor)); nested dataclasses (PackedBatch, PromptTrees)
    handled too."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            changes[f.name] = _move(v, fn)
    return dataclasses.replace(obj, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class PromptTrees:
    """The shared-prompt layout of a packed row (trainer.batching.shared_prompt builds it).

    The samples of one prompt (a GRPO group) form a prefix tree (a trie): every run of tokens that several samples
    have alike at the same positions (the prompt, the start the responses share, a later part some of them share)
    is one node, laid out once, in depth-first order, so a node's subtree is a contiguous run of the row. Row
    positions keep the unshared sequence's numbering, and a token attends the tokens before it on its own path
    (its node's earlier tokens and its ancestors'), so every hidden state equals the one of the sample's own
    sequence (trainer.backend.attention builds the attention from `end` or `paths`). Loss rows: a node's last token
    predicts the first token of each child, so the loss runs on M gathered rows, not on the N row tokens.

    The attention rule in one vector: query i attends key j iff j <= i < end[j] (end[j]: the row end of j's node's
    subtree; the padding tail's tokens have end N, one causal block).
    """

    end: torch.Tensor  # [N] int64: one past the last row token that attends token j (its node's subtree end)
    hidden_index: torch.Tensor  # [M] int64: the row position whose hidden state feeds loss row m
    # host: each branch's (sample's, in row order) sequence as row ranges [start, stop), ancestors first
    paths: tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatch:
    """One packed row plus its training targets. N = bucketed row length; host sizes are plain ints.

    With `trees` (the shared-prompt layout) the per-token targets below (labels ... rollout_logprobs, segments)
    are over the M loss rows of `trees.hidden_index` instead of the N row tokens; the math is the same.
    """

    row: PackedBatch  # input_ids [N], position_ids [N], seq_index [N], cu_seqlens [S+1], lengths (host)
    labels: torch.Tensor  # [N] int64 next-token targets, IGNORE_INDEX off the response
    loss_mask: torch.Tensor  # [N] float32 in {0, 1}
    advantages: torch.Tensor  # [N] float32
    num_tokens: int  # global number of loss tokens (sum of loss_mask over every micro-batch of every rank)
    num_seqs: int  # global number of sequences
    segments: torch.Tensor | None = None  # [S+2] int32: cu_seqlens plus the padding tail as one more segment (= N)
    local_tokens: int = 0  # loss tokens of this micro-batch (host int, known when built: no device read)
    sample_index: tuple[int, ...] = ()  # indices (into the sample list) of the S sequences, in row order
    old_logprobs: torch.Tensor | None = None  # [N] float32, log pi_old(label)
    ref_logprobs: torch.Tensor | None = None  # [N] float32, log pi_ref(label)
    rollout_logprobs: torch.Tensor | None = None  # [N] float32, the engine's log-probs
    trees: PromptTrees | None = None  # the shared-prompt layout (None: one sequence per sample)
    # PPO with a value model (trainer.backend.critic.attach_gae): the values before the update and the GAE returns, per
    # token like the advantages (then per token too); None otherwise.
    old_values: torch.Tensor | None = None  # [N] float32
    returns: torch.Tensor | None = None  # [N] float32

    def loss_inputs(self) -> LossInputs:
        """The per-token inputs of the policy loss (kernels.LossInputs) for this micro-batch.

        Sequences for the per-sequence aggregations are `segments`: the real ones plus the padding tail (mask 0,
        contributes 0); the global num_tokens / num_seqs keep the normalisation exact.
        """
        return LossInputs(labels=self.labels, advantages=self.advantages, mask=self.loss_mask,
                          old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs,
                          rollout_logprobs=self.rollout_logprobs, cu_seqlens=self.segments,
                          num_tokens=self.num_tokens, num_seqs=self.num_seqs)

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        """Every tensor on `device` (non_blocking copies overlap compute only from pinned host memory)."""
        return _move(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> MicroBatch:
        """Host tensors in page-locked memory (for non_blocking copies); device tensors (old / ref log-probs from
        `compute_logprobs`) are already where they go and are kept as they are."""
        return _move(self, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def bucketed_length(n: int, bucket_size: int) -> int:
    """n rounded up to a multiple of bucket_size (at least one bucket)."""
    return max(1, -(-n // bucket_size)) * bucket_size


def _padding_row(n: int, *, pad_id: int, num_tokens: int, num_seqs: int) -> MicroBatch:
    """An all-padding row (a rank with fewer micro-batches than the others still runs the same forwards)."""
    zeros = torch.zeros(n, dtype=torch.float32)
    row = PackedBatch(input_ids=torch.full((n,), pad_id, dtype=torch.int64), position_ids=torch.arange(n),
                      seq_index=torch.full((n,), -1, dtype=torch.int64), cu_seqlens=torch.zeros(1, dtype=torch.int32),
                      loss_mask=zeros, lengths=())
    return MicroBatch(row=row, labels=torch.full((n,), IGNORE_INDEX, dtype=torch.int64), loss_mask=zeros,
                      advantages=zeros, num_tokens=num_tokens, num_seqs=num_seqs,
                      segments=torch.tensor([0, n], dtype=torch.int32))


def pack_micro_batch(samples: Sequence[Sample], indices: Sequence[int], *, advantages: Sequence[float],
                     bucket_size: int, pad_id: int, num_tokens: int, num_seqs: int) -> MicroBatch:
    """Pack samples[indices] into one bucketed row (host tensors). Empty `indices` gives an all-padding row.

    The host only concatenates each sample's token ids and per-response-token values; the layout (positions,
    sequence index), the next-token shift and the advantage broadcast are the packing kernels' (kernels.packing).
    """
    chosen = [samples[i] for i in indices]
    lengths = tuple(len(s.tokens) for s in chosen)
    total = sum(lengths)
    n = bucketed_length(total, bucket_size)
    if not chosen:
        return _padding_row(n, pad_id=pad_id, num_tokens=num_tokens, num_seqs=num_seqs)
    ids = torch.tensor(list(itertools.chain.from_iterable(s.tokens for s in chosen)), dtype=torch.int64)
    ids = F.pad(ids, (0, n - total), value=pad_id)  # [n]
    cu = [0, *itertools.accumulate(lengths)]
    pos, seq = packed_layout(torch.tensor(cu, dtype=torch.int32), total=n)  # [n] each; seq -1 on the tail
    prompt_len = broadcast_to_tokens(torch.tensor([s.prompt_length for s in chosen], dtype=torch.int64), seq, fill=n)
    is_response = pos >= prompt_len  # [n] bool: token t is a response token
    response_at = is_response.nonzero().squeeze(1)  # host tensor: no device involved yet

    def shifted(per_response: Iterable[Sequence[float]]) -> torch.Tensor:
        """Per-response-token values -> [n] at the position predicting each token (0 elsewhere)."""
        flat = torch.tensor(list(itertools.chain.from_iterable(per_response)), dtype=torch.float32)
        return shift_left(torch.zeros(n, dtype=torch.float32).index_put_((response_at,), flat), seq)

    predicts_response = shift_left(is_response, seq, fill=False)  # position j predicts a response token
    labels = torch.where(predicts_response, shift_left(ids, seq), IGNORE_INDEX)
    if all(s.loss_mask is None for s in chosen):
        mask = predicts_response.float()
    else:
        mask = shifted(s.effective_loss_mask for s in chosen)
    adv = broadcast_to_tokens(torch.tensor([float(advantages[i]) for i in indices], dtype=torch.float32), seq)
    has_rollout = any(s.rollout_logprobs is not None for s in chosen)
    row = PackedBatch(input_ids=ids, position_ids=pos, seq_index=seq, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                      loss_mask=mask, lengths=lengths)
    return MicroBatch(
        row=row, labels=labels, loss_mask=mask, advantages=adv, num_tokens=num_tokens, num_seqs=num_seqs,
        segments=torch.tensor(cu + ([n] if n > total else []), dtype=torch.int32),
        # With an empty prompt the first response token has no position predicting it.
        local_tokens=sum(sum(s.effective_loss_mask[1 if s.prompt_length == 0 else 0:]) for s in chosen),
        sample_index=tuple(indices),
        rollout_logprobs=shifted(s.rollout_logprobs or (0.0,) * s.response_length for s in chosen)
        if has_rollout else None)


def check_batch_inputs(samples: Sequence[Sample], *, token_budget: int, bucket_size: int,
                       advantages: Sequence[float] | None, num_ranks: int, rank: int) -> tuple[list[float], int]:
    """Validate the inputs of a micro-batch builder; returns (one advantage per sample, global loss tokens)."""
    if not samples:
        raise ValueError("samples: need at least one sample to build micro-batches")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank}: must be in [0, num_ranks={num_ranks})")
    if token_budget < bucket_size:
        raise ValueError(f"token_budget={token_budget} is smaller than bucket_size={bucket_size}")
    lengths = [len(s.tokens) for s in samples]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"samples[{i}] has {n} tokens > token_budget={token_budget}; raise token_budget or "
                         f"truncate the sample")
    if any(n < 1 for n in lengths):
        raise ValueError("samples: every sample needs at least one token")
    adv = [0.0] * len(samples) if advantages is None else [float(a) for a in advantages]
    if len(adv) != len(samples):
        raise ValueError(f"advantages: need one per sample ({len(samples)}), got {len(adv)}")
    # With an empty prompt the first response token has no position predicting it: it is never trained.
    num_tokens = sum(sum(s.effective_loss_mask[1 if s.prompt_length == 0 else 0:]) for s in samples)
    return adv, num_tokens


def rank_micro_batches(plan: list[list[list[int]]], rank: int) -> list[list[int]]:
    """This rank's micro-batches of a plan, padded with empty ones to the most any rank has (ranks step together)."""
    n_micro = max(len(per_rank) for per_rank in plan)
    return list(plan[rank]) + [[]] * (n_micro - len(plan[rank]))


def build_micro_batches(samples: Sequence[Sample], *, token_budget: int, bucket_size: int,
                        advantages: Sequence[float] | None = None, pad_id: int = 0, num_ranks: int = 1,
                        rank: int = 0) -> list[MicroBatch]:
    """This rank's packed micro-batches for `samples` (host tensors; forward_backward moves them).

    advantages: one float per sample (default 0, e.g. for SFT). Old / ref log-probs come from the trainer's own
    forward (`compute_logprobs`) and are attached afterwards with `attach_logprobs`. Every rank must call this
    with the same arguments (the plan is deterministic), so all ranks agree on the number of micro-batches.
    """
    adv, num_tokens = check_batch_inputs(samples, token_budget=token_budget, bucket_size=bucket_size,
                                         advantages=advantages, num_ranks=num_ranks, rank=rank)
    lengths = [len(s.tokens) for s in samples]
    mine = rank_micro_batches(plan_micro_batches(lengths, token_budget=token_budget, num_ranks=num_ranks), rank)
    return [pack_micro_batch(samples, idx, advantages=adv, bucket_size=bucket_size, pad_id=pad_id,
                             num_tokens=num_tokens, num_seqs=len(samples)) for idx in mine]


def attach_logprobs(micro_batches: Sequence[MicroBatch], logprobs: Sequence[torch.Tensor],
                    field: str) -> list[MicroBatch]:
    """Micro-batches with `field` ("old_logprobs" / "ref_logprobs") set from `compute_logprobs` output."""
    if field not in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        raise ValueError(f"field={field!r}: expected old_logprobs, ref_logprobs or rollout_logprobs")
    if len(logprobs) != len(micro_batches):
        raise ValueError(f"logprobs: one tensor per micro-batch ({len(micro_batches)}), got {len(logprobs)}")
    return [dataclasses.replace(mb, **{field: lp.detach()}) for mb, lp in zip(micro_batches, logprobs)]
