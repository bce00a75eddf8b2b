"""`policy_loss`: the RL policy loss from logits, the row-softmax kernels under the torch objective layer.

    logits [N, V] ──token log-prob kernels (kernels/logprobs.py)──► logp, H [N]
                  ──objective (kernels/objective.py: ratio, clipping, KL, entropy, corrections, aggregation)──► loss
    backward: autograd through the objective gives g_logp = ∂loss/∂logp and g_ent = ∂loss/∂H per token, and the
              log-prob backward kernel turns them into dlogits = [g_logp (onehot − p) − g_ent ∂H/∂z] / T.

There is no policy-specific kernel: the per-token objective works on [N] vectors, so every objective (ppo, gspo,
cispo) and every option runs through the same two kernels. Labels equal to -100 count as masked.

GPU bytes moved per call (b = bytes per logit, N rows of which N_k are kept): forward reads the logits once,
N_k·V·b; backward reads them once more, N_k·V·b, and writes dlogits, N·V·b (exact zeros on masked rows). The
objective moves O(N) bytes. Metrics stay on the device, and so do the data checks (`input_errors`, see
kernels/objective.py): no host sync on an accelerator.
"""

from __future__ import annotations

import torch

from kernels.device import backend_for
from kernels.logprobs import logprob_rows
from kernels.objective import PolicyLossConfig, policy_objective, prepare_token_inputs, raise_on_input_errors

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_temperature(temperature) -> float:
    """1 / temperature, after checking that temperature is a positive number."""
    if isinstance(temperature, torch.Tensor) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be a positive python number (the rollout's sampling "
                         "temperature)")
    return 1.0 / float(temperature)


def policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    temperature: float = 1.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    num_tokens=None,
    num_seqs=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss from logits: (scalar loss, {metric name: 0-d device tensor}).

    logits [B, L, V] (rows are sequences) or [T, V] packed with cu_seqlens [S+1]; labels, advantages, mask and
    the optional old/ref/rollout (engine) log-probs are shaped like labels ([B, L] or [T]). temperature: the
    rollout's sampling temperature (log-probs of softmax(logits / temperature)). num_tokens / num_seqs: the counts
    that normalise the loss (default: this call's kept tokens and sequences); pass the global counts of the step so
    that micro-batches and ranks sum to the full-batch loss. Metrics are described in kernels/objective.py; they
    include `input_errors` (0-d int32, 0 = fine): pass it to `raise_on_input_errors` when the results are read
    (on CPU a bad input has already raised ValueError).
    """
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} must be labels shape {tuple(labels.shape)} + [V]")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not supported; use one of {_LOGIT_DTYPES}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous; call .contiguous() (e.g. after slicing off the last position)")
    inv_t = check_temperature(temperature)
    vocab = logits.shape[-1]
    tok, errors = prepare_token_inputs(
        labels, advantages, mask, config=config, vocab_size=vocab, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
        num_tokens=num_tokens, num_seqs=num_seqs,
    )
    logp, entropy = logprob_rows(logits.view(-1, vocab), tok.labels, tok.keep, inv_t, config.needs_entropy,
                                 False, backend_for(logits))
    loss, metrics = policy_objective(logp, entropy, tok, config)
    metrics["input_errors"] = errors
    return loss, metrics


__all__ = ["PolicyLossConfig", "policy_loss", "raise_on_input_errors"]
