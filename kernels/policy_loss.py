"""`policy_loss`: the RL policy loss from logits, the row-softmax kernels under the torch objective layer.

    logits [N, V] ──token log-prob kernels (kernels/logprobs.py)──► logp, H [N]
                  ──objective (kernels/objective.py: ratio, clipping, KL, entropy, corrections, aggregation)──► loss
    backward: autograd through the objective gives g_logp = ∂loss/∂logp and g_ent = ∂loss/∂H per token, and the
              log-prob backward kernel turns them into dlogits = [g_logp (onehot − p) − g_ent ∂H/∂z] / T.

There is no policy-specific kernel: the per-token objective works on [N] vectors, so every objective (ppo, gspo,
cispo, any registered one) and every option runs through the same two kernels. Labels equal to -100 count as
masked.

GPU bytes moved per call (b = bytes per logit, N rows of which N_k are kept): forward reads the logits once,
N_k·V·b; backward reads them once more, N_k·V·b, and writes dlogits, N·V·b (exact zeros on masked rows). The
objective moves O(N) bytes. Metrics stay on the device, and so do the data checks (`input_errors`, see
kernels/objective.py): no host sync on an accelerator.
"""

from __future__ import annotations

import torch

from kernels.device import backend_for
from kernels.logprobs import FLOAT_DTYPES, logprob_rows
from kernels.objective import (
    LossInputs,
    PolicyLossConfig,
    check_loss_inputs,
    policy_objective,
    prepare_token_inputs,
    raise_on_input_errors,
)


def check_temperature(temperature) -> float:
    """1 / temperature, after checking that temperature is a positive number."""
    if isinstance(temperature, torch.Tensor) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be a positive python number (the rollout's sampling "
                         "temperature)")
    return 1.0 / float(temperature)


def policy_loss(
    logits: torch.Tensor, inputs: LossInputs, *, config: PolicyLossConfig, temperature: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss from logits: (scalar loss, {metric name: 0-d device tensor}).

    logits [B, L, V] (rows are sequences) or [T, V] packed; `inputs` (kernels.LossInputs) holds the per-token
    labels, advantages, mask, the optional old/ref/rollout (engine) log-probs shaped like labels ([B, L] or [T]),
    cu_seqlens [S+1] for packed labels and the counts that normalise the loss. temperature: the rollout's sampling
    temperature (log-probs of softmax(logits / temperature)). Metrics are described in kernels/objective.py; they
    include `input_errors` (0-d int32, 0 = fine): pass it to `raise_on_input_errors` when the results are read
    (on CPU a bad input has already raised ValueError).
    """
    labels = check_loss_inputs(inputs).labels
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} must be labels shape {tuple(labels.shape)} + [V]")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not supported; use one of {FLOAT_DTYPES}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous; call .contiguous() (e.g. after slicing off the last position)")
    inv_t = check_temperature(temperature)
    vocab = logits.shape[-1]
    tok, errors = prepare_token_inputs(inputs, config=config, vocab_size=vocab)
    logp, entropy = logprob_rows(logits.view(-1, vocab), tok.labels, tok.keep, inv_t, config.needs_entropy,
                                 False, backend_for(logits))
    loss, metrics = policy_objective(logp, entropy, tok, config)
    metrics["input_errors"] = errors
    return loss, metrics


__all__ = ["LossInputs", "PolicyLossConfig", "policy_loss", "raise_on_input_errors"]
