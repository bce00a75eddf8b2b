"""`masked_scale(x, mask, alpha)`: y = alpha * x where mask, else 0.

The project's smallest kernel. It exists to prove the device policy end to end (CUDA -> Triton,
CPU -> torch, TRITON_INTERPRET=1 -> Triton interpreter) and is the pattern every other op follows:
kernel, host launcher that checks and allocates, public function that dispatches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import backend_for


@triton.jit
def _masked_scale_kernel(x_ptr, m_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    # int64 offsets: n can exceed 2**31 for packed [T, V] buffers.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=inb, other=0)
    y = tl.where(m != 0, x * alpha, 0.0)
    tl.store(y_ptr + offs, y, mask=inb)


def _masked_scale_triton(x: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        BLOCK = 1024
        _masked_scale_kernel[(triton.cdiv(n, BLOCK),)](x, mask, y, n, float(alpha), BLOCK=BLOCK)
    return y


def _masked_scale_torch(x: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.where(mask.bool(), x.float() * alpha, 0.0)


def masked_scale(x: torch.Tensor, mask: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """fp32 `alpha * x` where `mask` is nonzero, 0 elsewhere; `x` and `mask` of the same shape."""
    if x.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != x shape {tuple(x.shape)}; pass one mask value per element")
    if not (x.is_contiguous() and mask.is_contiguous()):
        raise ValueError("x and mask must be contiguous; call .contiguous() on them first")
    if backend_for(x) == "triton":
        return _masked_scale_triton(x, mask, alpha)
    return _masked_scale_torch(x, mask, alpha)
