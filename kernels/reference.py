"""Plain-torch references, written for clarity, not speed (design rule 5).

Tests evaluate these in float64 and compare both the Triton and the torch paths of every op against them.
Each section belongs to one op; keep them readable: log_softmax + gather, explicit formulas, no fusion.
"""

from __future__ import annotations



# ---------------------------------------------------------------------------------------------------------
# Token log-probs and entropy (kernels/logprobs.py, kernels/linear_logprobs.py)
# ---------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------
# Policy loss (kernels/policy_loss.py, kernels/linear_policy_loss.py)
# ---------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------
# Packing (kernels/packing.py)
# ---------------------------------------------------------------------------------------------------------
