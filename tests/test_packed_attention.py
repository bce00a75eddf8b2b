"""Packed attention: a packed row's forward/backward equals each sequence run alone (tiny Llama / Qwen2, fp32)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, Qwen2Config

import trainer.backend.attention as attention
from kernels import pack_batch, shift_left, use_backend
from kernels.packing import packed_layout
from kernels.reference import block_causal_mask_reference
from trainer.backend.attention import (
    PACKED_SDPA,
    block_causal_mask,
    default_attn_implementation,
    flex_block_mask,
    packed_attention_kwargs,
    packed_hidden_states,
    packed_logits,
    packed_sdpa_attention,
    packed_segment_indices,
)

V = 97


def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0, kv_heads: int = 2):
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    cfg = cls(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def random_sequences(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


LENGTHS = [7, 1, 23, 12, 40]  # includes a one-token sequence; 83 real tokens


def test_block_causal_mask_matches_reference():
    seq = torch.tensor([0, 0, 0, 1, 2, 2, -1, -1])
    ref = block_causal_mask_reference(seq.tolist())
    m = block_causal_mask(seq)
    assert m.shape == (1, 1, 8, 8) and m.dtype == torch.bool and torch.equal(m[0, 0], ref)
    f = block_causal_mask(seq, torch.float32)
    assert torch.equal(f[0, 0] == 0, ref) and (f[0, 0][~ref] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", [PACKED_SDPA, "sdpa", "eager"])
@pytest.mark.parametrize("pad_to", [None, 128])
def test_packed_logits_equal_per_sequence_logits(arch, attn, pad_to):
    model = tiny_model(arch, attn).eval()  # 4 query heads over 2 kv heads: GQA
    seqs = random_sequences(1, LENGTHS)
    with use_backend("torch"):
        batch = pack_batch(seqs, pad_to=pad_to)
    if attn == PACKED_SDPA:  # the gathered path runs (not the plain-sdpa fallback) and no N x N mask is built
        kw = packed_attention_kwargs(model, batch)
        # Eager blocks: the sequences in batches of alike lengths (trainer.backend.sdpa_chunks); these five lengths
        # differ enough that each is its own chunk, so nothing is padded.
        assert sorted(kw["packed_chunks"]) == sorted((1, n) for n in LENGTHS)
        assert kw["packed_gather_index"].shape == (sum(LENGTHS),)
        assert kw["attention_mask"].shape == (1, 1, 0, 0)  # the placeholder: transformers passes it through
    with torch.no_grad():
        packed = packed_logits(model, batch)  # [N, V]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])  # [T, V]
        hidden = packed_hidden_states(model, batch)
        hidden_alone = torch.cat([model.model(input_ids=s[None]).last_hidden_state[0] for s in seqs])
    T = sum(LENGTHS)
    assert packed.shape == (batch.padded_len, V) and hidden.shape == (batch.padded_len, 64)
    torch.testing.assert_close(packed[:T], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden[:T], hidden_alone, rtol=0, atol=1e-5)
    assert torch.isfinite(packed).all()  # the padding tail is its own block: no empty softmax rows


def test_without_document_mask_the_row_leaks():
    # The comparison above can fail: a plain causal mask over the row (what position_ids alone give SDPA when
    # transformers does not detect packing) mixes sequences and moves the logits far beyond 1e-5.
    model = tiny_model("llama").eval()
    seqs = random_sequences(2, LENGTHS)
    with use_backend("torch"):
        batch = pack_batch(seqs)
    kw = packed_attention_kwargs(model, batch)
    kw["attention_mask"] = block_causal_mask(torch.zeros_like(batch.seq_index))
    with torch.no_grad():
        leaky = model(**kw).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
    assert (leaky - alone).abs().max() > 1e-2


def _token_loss(logits, targets, weights):
    # Weighted next-token NLL; the weights are random so every token's gradient is distinct and non-trivial.
    nll = F.cross_entropy(logits, targets.clamp(min=0), reduction="none")
    return (nll * weights * (targets >= 0)).sum()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_loss_gradients_equal_sum_of_per_sequence_gradients(arch):
    model = tiny_model(arch).train()
    seqs = random_sequences(3, LENGTHS)
    g = torch.Generator().manual_seed(4)
    weights = [torch.rand(n, generator=g) + 0.5 for n in LENGTHS]
    with use_backend("torch"):
        batch = pack_batch(seqs, pad_to=96)
    targets = shift_left(batch.input_ids, batch.seq_index, fill=-100)
    w = torch.cat(weights + [torch.zeros(batch.padded_len - batch.num_tokens)])
    _token_loss(packed_logits(model, batch), targets, w).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    for s, wt in zip(seqs, weights):
        t = torch.cat([s[1:], torch.tensor([-100])])
        _token_loss(model(input_ids=s[None]).logits[0], t, wt).backward()  # grads accumulate: the sum
    for name, p in model.named_parameters():
        rel = (packed[name] - p.grad).norm() / p.grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_packed_segment_indices_match_a_loop():
    g = torch.Generator().manual_seed(11)
    for _ in range(5):
        lengths = tuple(int(n) for n in torch.randint(0, 9, (int(torch.randint(1, 6, (1,), generator=g)),),
                                                      generator=g))
        lengths = lengths + (1,)  # at least one non-empty sequence
        n = sum(lengths) + int(torch.randint(0, 4, (1,), generator=g))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        with use_backend("torch"):
            gather, scatter = packed_segment_indices(packed_layout(cu, total=n)[1], lengths)
        segs = [x for x in lengths if x > 0]
        lmax, start, flat = max(segs), 0, []
        assert gather.shape == (len(segs), lmax)
        for s, ln in enumerate(segs):
            assert gather[s].tolist() == [start + min(j, ln - 1) for j in range(lmax)]
            flat += [s * lmax + j for j in range(ln)]
            start += ln
        assert scatter.tolist() == flat + [len(segs) * lmax] * (n - start)  # the tail reads the zero row


class _Attn(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_packed_sdpa_attention_equals_dense_block_causal_sdpa(kv_heads):
    # The attention function alone, forward and backward, against SDPA with the dense document mask (the
    # reference path), with a non-default scale and GQA by repeat_interleave.
    g = torch.Generator().manual_seed(12)
    with use_backend("torch"):
        batch = pack_batch(random_sequences(12, [9, 1, 30, 4]), pad_to=56)
    gather, scatter = packed_segment_indices(batch.seq_index, batch.lengths)
    q = torch.randn(1, 4, 56, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 56, 8, generator=g, requires_grad=True) for _ in range(2))
    out, _ = packed_sdpa_attention(_Attn(), q, k, v, None, scaling=0.3, packed_gather_index=gather,
                                   packed_scatter_index=scatter)  # [1, N, H, D]
    rep = 4 // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=block_causal_mask(batch.seq_index), scale=0.3).transpose(1, 2)
    T = batch.num_tokens
    torch.testing.assert_close(out[:, :T], ref[:, :T], rtol=0, atol=1e-6)
    assert (out[:, T:] == 0).all()  # the padding tail is not attended: zeros
    w = torch.randn(out.shape, generator=g)
    w[:, T:] = 0  # the tail's outputs are never used
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_sdpa_gradients_equal_dense_mask_gradients(arch):
    seqs = random_sequences(13, LENGTHS)
    g = torch.Generator().manual_seed(14)
    with use_backend("torch"):
        batch = pack_batch(seqs, pad_to=96)
    targets = shift_left(batch.input_ids, batch.seq_index, fill=-100)
    w = torch.cat([torch.rand(batch.num_tokens, generator=g) + 0.5, torch.zeros(batch.padded_len - batch.num_tokens)])
    grads = {}
    for attn in (PACKED_SDPA, "sdpa"):
        model = tiny_model(arch, attn).train()  # same seed: same weights; attention dropout 0 in these configs
        _token_loss(packed_logits(model, batch), targets, w).backward()
        grads[attn] = {n: p.grad for n, p in model.named_parameters()}
    for name, ref in grads["sdpa"].items():
        rel = (grads[PACKED_SDPA][name] - ref).norm() / ref.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_packed_sdpa_single_segment_row_is_plain_causal():
    model = tiny_model("llama", PACKED_SDPA, kv_heads=4).eval()
    (seq,) = random_sequences(15, [33])
    with use_backend("torch"):
        batch = pack_batch([seq])
    kw = packed_attention_kwargs(model, batch)
    assert "packed_gather_index" not in kw  # one segment: no gather needed
    with torch.no_grad():
        torch.testing.assert_close(packed_logits(model, batch), model(input_ids=seq[None]).logits[0], rtol=0,
                                   atol=1e-5)


def test_packed_sdpa_without_packing_kwargs_is_sdpa_with_padding_mask():
    # Models loaded for CPU training are also used for plain padded batches (references, engines): there
    # packed_sdpa must be transformers' sdpa, 2D padding mask included.
    model, ref = tiny_model("qwen2", PACKED_SDPA).eval(), tiny_model("qwen2", "sdpa").eval()
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(16))
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 7:] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=am).logits,
                                   ref(input_ids=ids, attention_mask=am).logits, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_equals_dense_block_causal_mask():
    # FlexAttention's document mask (the CUDA path without flash-attn) against SDPA with the dense mask, run
    # through flex_attention's eager implementation on CPU; the full model goes through it in the gpu test.
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(6)
    with use_backend("torch"):
        batch = pack_batch(random_sequences(6, [30, 5, 60, 1]), pad_to=128)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch.seq_index))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(batch.seq_index))
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)


def _document_causal(seq_index: torch.Tensor):
    def document_causal(b, h, q_idx, kv_idx):
        return (seq_index[q_idx] == seq_index[kv_idx]) & (kv_idx <= q_idx)

    return document_causal


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_flex_block_mask_tables_equal_create_block_mask(block_size):
    # The tile tables built from the documents' extents equal create_block_mask's (which evaluates the mask_mod
    # on all N^2 pairs), on random packed layouts: empty sequences, one-token ones, a padding tail or none, N a
    # multiple of the tile or not, N below one tile.
    from torch.nn.attention.flex_attention import create_block_mask

    from kernels.packing import packed_layout

    def n_tiles(n: int) -> int:
        return -(-n // block_size)

    g = torch.Generator().manual_seed(block_size)
    kinds: set[str] = set()  # the layouts exercised full tiles and skipped (empty) causal tiles
    for trial in range(25):
        s = int(torch.randint(1, 12, (), generator=g))
        lengths = torch.randint(0, 3 * block_size, (s,), generator=g)
        lengths[torch.rand(s, generator=g) < 0.2] = torch.randint(0, 2, (), generator=g)  # empty / one-token
        if lengths.sum() == 0:
            lengths[0] = 1
        total = int(lengths.sum())
        tail = [0, 1, block_size - total % block_size, int(torch.randint(1, 2 * block_size, (), generator=g))]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        _, seq_index = packed_layout(cu, total + tail[trial % 4])
        n = seq_index.shape[0]
        new = flex_block_mask(seq_index, block_size)
        old = create_block_mask(_document_causal(seq_index), B=None, H=None, Q_LEN=n, KV_LEN=n, device="cpu",
                                BLOCK_SIZE=block_size)
        kinds |= {"full"} if new.full_kv_num_blocks.sum() > 0 else set()
        kinds |= {"skipped"} if (new.kv_num_blocks + new.full_kv_num_blocks < torch.arange(1, n_tiles(n) + 1)).any() \
            else set()
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(new, name), getattr(old, name)), (name, lengths.tolist(), n)
        assert new.seq_lengths == old.seq_lengths == (n, n)
        assert torch.equal(new.to_dense(), old.to_dense())
        # The element mask the kernel applies on partial tiles is the dense document-causal mask.
        dense = block_causal_mask(seq_index)[0, 0]
        q_idx, kv_idx = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        assert torch.equal(new.mask_mod(0, 0, q_idx, kv_idx), dense)
    assert kinds == {"full", "skipped"}


def test_flex_block_tiles_mark_full_and_skipped_tiles():
    # Two 8-token sequences then a 4-token padding tail at tile 4: hand-checked tables.
    seq_index = torch.tensor([0] * 8 + [1] * 8 + [-1] * 4)
    partial, full = attention.flex_block_tiles(seq_index, block_size=4)
    expected_full = torch.zeros(5, 5, dtype=torch.bool)
    expected_full[1, 0] = expected_full[3, 2] = True
    expected_partial = torch.eye(5, dtype=torch.bool)  # diagonal tiles: causal inside the tile
    assert torch.equal(full, expected_full) and torch.equal(partial, expected_partial)


def _varlen_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # A stand-in for flash-attn's varlen kernel: causal SDPA on each cu_seq_lens_q segment. It proves the varlen
    # kwargs reach every layer with segments that reproduce per-sequence attention.
    cu = kwargs["cu_seq_lens_q"].tolist()
    # A function of its own under the name gets no mask (the placeholder is for tree_flash_attention only)
    assert attention_mask is None and kwargs["max_length_q"] == max(b - a for a, b in zip(cu[:-1], cu[1:]))
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = torch.cat([
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                       scale=scaling)
        for a, b in zip(cu[:-1], cu[1:])
    ], dim=2)
    return out.transpose(1, 2).contiguous(), None


def test_varlen_kwargs_path_matches_per_sequence(monkeypatch):
    AttentionInterface.register("varlen_sdpa_test", _varlen_sdpa)
    monkeypatch.setattr(attention, "_FLASH", (*attention._FLASH, "varlen_sdpa_test"))
    model = tiny_model("qwen2", "varlen_sdpa_test").eval()
    ref_model = tiny_model("qwen2", "sdpa").eval()  # same seed, same weights
    seqs = random_sequences(7, LENGTHS)
    with use_backend("torch"):
        batch = pack_batch(seqs, pad_to=100)
    kw = packed_attention_kwargs(model, batch)
    assert kw["cu_seq_lens_q"].tolist() == [0, 7, 8, 31, 43, 83, 100]  # the padding tail is the last segment
    with torch.no_grad():
        packed = packed_logits(model, batch)
        alone = torch.cat([ref_model(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed[:83], alone, rtol=0, atol=1e-5)


def test_unknown_attn_implementation_is_a_clear_error():
    model = tiny_model("llama")
    model.config._attn_implementation = "paged|sdpa"
    with use_backend("torch"):
        batch = pack_batch(random_sequences(8, [3, 4]))
    with pytest.raises(ValueError, match="no packed path"):
        packed_attention_kwargs(model, batch)


def test_default_attn_implementation_follows_the_device():
    assert default_attn_implementation("cpu") == PACKED_SDPA
    expected = "flash_attention_2" if attention.flash_attn_available() else "flex_attention"
    assert default_attn_implementation("cuda") == expected


def test_fp32_models_never_get_flash_attn(monkeypatch):
    """flash-attn rejects fp32 q/k/v (issue 26 item 3): with it installed, an fp32 model (this file's GPU test,
    [trainer] param_dtype = "float32") takes FlexAttention, with the reason; half precision keeps flash-attn."""
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    impl, why = attention.choose_attn_implementation("cuda", torch.float32)
    assert impl == "flex_attention" and "float32" in why and "bfloat16" in why
    assert default_attn_implementation("cuda", torch.bfloat16) == "flash_attention_2"
    assert default_attn_implementation("cuda", torch.float16) == "flash_attention_2"
    assert default_attn_implementation("cpu", torch.bfloat16) == PACKED_SDPA

    import trainer.backend.models as models
    from trainer.backend.parallel import ParallelConfig

    chosen = []

    class Stop(Exception):
        pass

    def record(config, impl):
        chosen.append(impl)
        raise Stop

    monkeypatch.setattr(models, "_build_meta", record)
    cfg = tiny_model("llama").config
    for kw in ({"dtype": torch.float32},  # a plain fp32 model (references, this file's GPU test)
               {"mesh": object(), "parallel": ParallelConfig(param_dtype="float32")},  # the fp32 trainer
               {"mesh": object(), "parallel": ParallelConfig()}):  # the default trainer: bf16 compute
        with pytest.raises(Stop):
            models.load_hf_model(cfg, device="cuda", **kw)
    assert chosen == ["flex_attention", "flex_attention", "flash_attention_2"]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_logits_on_cuda_default_attention(arch):
    impl = default_attn_implementation("cuda", torch.float32)  # tiny_model is fp32: never flash-attn
    model = tiny_model(arch, impl).cuda().eval()
    ref = tiny_model(arch, "sdpa").cuda().eval()
    seqs = [s.cuda() for s in random_sequences(9, LENGTHS)]
    batch = pack_batch(seqs, pad_to=128)
    with torch.no_grad():
        packed = packed_logits(model, batch)
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed[:83], alone, rtol=0, atol=1e-4)
