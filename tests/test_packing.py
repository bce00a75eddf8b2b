"""Pack/unpack kernels, packed layout, per-sequence broadcast: Triton (interpreted) and torch paths vs reference."""

import textwrap

import pytest
import torch
from triton_compile import compile_in_subprocess

from kernels import (
    PackedBatch,
    broadcast_to_tokens,
    cu_seqlens_from_lengths,
    pack,
    pack_batch,
    packed_layout,
    shift_left,
    unpack,
)
from kernels.reference import (
    broadcast_to_tokens_reference,
    pack_reference,
    packed_layout_reference,
    unpack_reference,
)


def _lengths(g: torch.Generator, B: int, L: int) -> list[int]:
    lens = torch.randint(1, L + 1, (B,), generator=g).tolist()
    lens[int(torch.randint(0, B, (), generator=g))] = L  # one full row, so the max-length edge is exercised
    return lens


def _random(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


@pytest.mark.parametrize(
    "B,L,trail,dtype",
    [
        (1, 1, (), torch.float32),
        (5, 37, (), torch.int64),
        (7, 70, (), torch.float32),  # L > BLOCK_T: two token tiles per row
        (4, 9, (3,), torch.bfloat16),
        (3, 5, (300,), torch.float32),  # D > BLOCK_D: the feature loop runs twice
        (6, 13, (), torch.bool),
        (3, 11, (2, 5), torch.int32),
    ],
)
def test_pack_unpack_round_trip_matches_reference(backend, B, L, trail, dtype):
    g = torch.Generator().manual_seed(B * 1000 + L)
    lens = _lengths(g, B, L)
    padded = _random((B, L, *trail), dtype, g)
    T = sum(lens)
    for total, fill in ((None, 0), (T + 19, 1)):
        flat = pack(padded, lens, total=total, fill=fill)
        assert torch.equal(flat, pack_reference(padded, lens, total, fill))
        back = unpack(flat, lens, max_len=L + 2, fill=fill)
        assert torch.equal(back, unpack_reference(flat, lens, L + 2, fill))
        keep = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
        assert torch.equal(back[:, :L][keep], padded[keep])  # the round trip restores every real element


def test_pack_and_unpack_gradients_match_reference(backend):
    g = torch.Generator().manual_seed(3)
    B, L, D = 5, 23, 4
    lens = _lengths(g, B, L)
    T = sum(lens)
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64).float().requires_grad_()
    up = torch.randn(T + 7, D, generator=g)
    (pack(x, lens, total=T + 7) * up).sum().backward()
    x_ref = x.detach().double().requires_grad_()
    (pack_reference(x_ref, lens, T + 7) * up.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=0, atol=0)

    f = torch.randn(T + 3, D, generator=g).requires_grad_()
    up2 = torch.randn(B, L, D, generator=g)
    (unpack(f, lens, max_len=L, fill=5.0) * up2).sum().backward()
    f_ref = f.detach().double().requires_grad_()
    (unpack_reference(f_ref, lens, L, 5.0) * up2.double()).sum().backward()
    torch.testing.assert_close(f.grad.double(), f_ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("S,max_len,tail", [(1, 1, 0), (1, 40, 5), (4, 9, 0), (37, 20, 33), (300, 3, 1)])
def test_layout_matches_plain_python(backend, S, max_len, tail):
    g = torch.Generator().manual_seed(S * 7 + tail)
    lens = torch.randint(1, max_len + 1, (S,), generator=g).tolist()
    cu_ref, pos_ref, seq_ref = packed_layout_reference(lens, sum(lens) + tail)
    cu = cu_seqlens_from_lengths(lens)
    assert cu.dtype == torch.int32 and cu.tolist() == cu_ref
    pos, seq = packed_layout(cu, sum(lens) + tail)
    assert pos.dtype == seq.dtype == torch.int64
    assert pos.tolist() == pos_ref
    assert seq.tolist() == seq_ref
    if tail == 0:  # total defaults to cu_seqlens[-1]
        pos2, seq2 = packed_layout(cu)
        assert pos2.tolist() == pos_ref and seq2.tolist() == seq_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_broadcast_matches_reference(backend, dtype):
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 30, (13,), generator=g).tolist()
    _, _, seq_ref = packed_layout_reference(lens, sum(lens) + 10)
    seq = torch.tensor(seq_ref)
    values = _random((13,), dtype, g)
    out = broadcast_to_tokens(values, seq, fill=-3)
    expected = torch.tensor(broadcast_to_tokens_reference(values.tolist(), seq_ref, -3), dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, expected)


def test_broadcast_gradient_is_per_sequence_sum(backend):
    g = torch.Generator().manual_seed(5)
    lens = [4, 1, 9, 2]
    _, _, seq_ref = packed_layout_reference(lens, sum(lens) + 3)
    seq = torch.tensor(seq_ref)
    v = torch.randn(4, generator=g).requires_grad_()
    up = torch.randn(len(seq_ref), generator=g)
    (broadcast_to_tokens(v, seq) * up).sum().backward()
    v_ref = v.detach().double().requires_grad_()
    ref = torch.stack([v_ref[s] if s >= 0 else v_ref.new_zeros(()) for s in seq_ref])
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(v.grad.double(), v_ref.grad, rtol=1e-6, atol=1e-6)


def test_shift_left_gives_next_token_within_each_sequence():
    lens = [3, 1, 4]
    _, _, seq_ref = packed_layout_reference(lens, 10)
    ids = torch.randint(0, 50, (10,))
    out = shift_left(ids, torch.tensor(seq_ref), fill=-100)
    expected = [
        ids[i + 1].item() if i + 1 < 10 and seq_ref[i] >= 0 and seq_ref[i + 1] == seq_ref[i] else -100
        for i in range(10)
    ]
    assert out.tolist() == expected
    feats = torch.randn(10, 3)
    out2 = shift_left(feats, torch.tensor(seq_ref), fill=0.0)
    assert torch.equal(out2[0], feats[1]) and torch.equal(out2[2], torch.zeros(3))


def test_pack_batch_from_list_and_from_padded_agree(backend):
    g = torch.Generator().manual_seed(9)
    lens = [5, 2, 8]
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in lens]
    masks = [(torch.rand(n, generator=g) < 0.6).float() for n in lens]
    b = pack_batch(seqs, loss_mask=masks, pad_to=32, pad_id=0)
    assert isinstance(b, PackedBatch)
    assert b.padded_len == 32 and b.num_tokens == 15 and b.max_seqlen == 8 and b.lengths == (5, 2, 8)
    assert b.input_ids.tolist() == torch.cat(seqs).tolist() + [0] * 17
    assert b.loss_mask.tolist() == torch.cat(masks).tolist() + [0.0] * 17
    cu, pos, seq = packed_layout_reference(lens, 32)
    assert b.cu_seqlens.tolist() == cu and b.position_ids.tolist() == pos and b.seq_index.tolist() == seq
    padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=7)
    b2 = pack_batch(padded, lens, pad_to=32)
    assert torch.equal(b2.input_ids, b.input_ids)
    assert b2.loss_mask.tolist() == [1.0] * 15 + [0.0] * 17  # default mask: every real token
    with pytest.raises(dataclasses_frozen_error()):
        b.lengths = (1,)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_bad_input_is_a_clear_value_error():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        pack(x, [2, 0, 1])
    with pytest.raises(ValueError, match=r"lengths\[0\] = -2"):
        pack(x, [-2, 1, 1])
    with pytest.raises(ValueError, match="len\\(lengths\\) = 2 != padded.shape\\[0\\] = 3"):
        pack(x, [2, 1])
    with pytest.raises(ValueError, match=r"lengths\[2\] = 6 > padded.shape\[1\] = 5"):
        pack(x, [1, 1, 6])
    with pytest.raises(ValueError, match="total=3 < sum"):
        pack(x, [2, 2, 2], total=3)
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 9"):
        unpack(torch.randn(8), [3, 3, 3])
    with pytest.raises(ValueError, match="contiguous"):
        pack(torch.randn(5, 3).t(), [1, 1, 1])
    with pytest.raises(ValueError, match="pad_to=4"):
        pack_batch([torch.arange(3), torch.arange(2)], pad_to=4)
    with pytest.raises(ValueError, match="one value per sequence"):
        broadcast_to_tokens(torch.randn(2, 2), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="total=4 < cu_seqlens"):
        packed_layout(cu_seqlens_from_lengths([3, 2]), 4)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        pack(x, torch.tensor([1.0, 2.0, 3.0]))


# The interpreter accepts code the compiler rejects: compile every kernel for an H100 target (PTX through the
# ptxas bundled with triton; no GPU needed), in a subprocess because conftest turned the interpreter on here.
_COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.packing import _broadcast_kernel, _layout_kernel, _pack_kernel, _unpack_kernel

    target = GPUTarget("cuda", 90, 32)
    def build(fn, sig, consts):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        assert "ptx" in triton.compile(ASTSource(fn, sig, consts), target=target).asm
    for x, fill in (("*fp32", 0.5), ("*bf16", 0.0), ("*i64", -100), ("*u8", 0), ("*i32", 7)):
        for L in ("i32", "i64"):
            base = dict(len_ptr="*i32", cu_ptr="*i32", L=L, D="i32")
            build(_pack_kernel, dict(pad_ptr=x, flat_ptr=x, **base), dict(BLOCK_T=64, BLOCK_D=256))
            build(_unpack_kernel, dict(flat_ptr=x, pad_ptr=x, **base), dict(FILL=fill, BLOCK_T=64, BLOCK_D=4))
        build(_broadcast_kernel, dict(val_ptr=x, seq_ptr="*i64", out_ptr=x, N="i32"), dict(FILL=fill, BLOCK=256))
    for cu in ("*i32", "*i64"):
        build(_layout_kernel, dict(cu_ptr=cu, pos_ptr="*i64", seq_ptr="*i64", N="i32", S="i32"),
              dict(N_ITERS=7, BLOCK=256))
    print("compiled")
""")


def test_triton_kernels_compile_for_sm90():
    compile_in_subprocess(_COMPILE_SCRIPT)
