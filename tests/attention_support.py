"""Shared check for attention tests: an attention output against a reference's, forward and gradients."""

import torch


def assert_same_attention(out: torch.Tensor, want: torch.Tensor, inputs: tuple[torch.Tensor, ...], real: int,
                          g: torch.Generator, atol: float = 1e-12) -> None:
    """out and want [1, N, H, D] from the same q/k/v `inputs` (requiring grad): equal on the first `real` tokens,
    and so are the inputs' gradients under a random upstream gradient (float64 inputs: atol 1e-12)."""
    torch.testing.assert_close(out[:, :real], want[:, :real], atol=atol, rtol=0)
    up = torch.randn(out[:, :real].shape, generator=g, dtype=out.dtype)
    got = torch.autograd.grad((out[:, :real] * up).sum(), inputs, retain_graph=True)
    ref = torch.autograd.grad((want[:, :real] * up).sum(), inputs, retain_graph=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
