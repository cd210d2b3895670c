"""`vtoken::visual_attention` (the fused statistic an LLM-stage drop scores with): its PyTorch reference against
the attention of an eager softmax written out here, its Triton kernel against the reference (on CPU through
TRITON_INTERPRET=1 in a subprocess; natively on CUDA), and the custom op's registration (one op, meta shapes)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vtoken.kernels import visual_attention, visual_attention_reference
from vtoken.launches import count_launches


def _inputs(batch=2, heads=4, kv_heads=2, rows=3, seq=40, dim=8, visual=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g)
    positions = torch.randint(seq // 2, seq, (batch, rows), generator=g)
    positions[0, -1] = -1  # a missing row
    valid = torch.rand(batch, seq, generator=g) > 0.2
    slots = torch.randint(0, seq, (batch, visual), generator=g)
    slots[1, -2:] = -1  # missing slots
    return q, k, positions, valid, slots, dim**-0.5


def test_reference_is_the_head_mean_of_a_causal_softmax_by_hand():
    q, k, rows, valid, slots, scale = _inputs()
    got = visual_attention_reference(q, k, rows, valid, slots, scale)
    batch, heads, count = q.shape[0], q.shape[1], q.shape[2]
    for b in range(batch):
        for r in range(count):
            for v in range(slots.shape[1]):
                if rows[b, r] < 0 or slots[b, v] < 0:
                    assert got[b, r, v] == 0
                    continue
                total = 0.0
                for h in range(heads):
                    key = k[b, h // (heads // k.shape[1])]
                    seen = [j for j in range(k.shape[2]) if j <= rows[b, r] and valid[b, j]]
                    logits = torch.stack([(q[b, h, r] * key[j]).sum() * scale for j in seen])
                    probs = dict(zip(seen, logits.softmax(0).tolist(), strict=True))
                    total += probs.get(int(slots[b, v]), 0.0)
                assert abs(float(got[b, r, v]) - total / heads) < 1e-6


def test_one_op_with_meta_shapes():
    q, k, rows, valid, slots, scale = _inputs()
    with count_launches() as counted:
        visual_attention(q, k, rows, valid, slots, scale)
    assert counted.ops == {"vtoken::visual_attention": 1} and counted.syncs == 0
    meta = [t.to("meta") for t in (q, k, rows, valid, slots)]
    assert visual_attention(*meta, scale).shape == (2, 3, 7)


CHECK = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import visual_attention_reference, visual_attention_triton
    device = "{device}"
    for batch, heads, kv_heads, rows, seq, dim, visual, dtype in [(2, 4, 2, 3, 150, 16, 70, torch.float32),
                                                                   (1, 3, 3, 1, 70, 24, 9, torch.float16)]:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(batch, heads, rows, dim, generator=g).to(device, dtype)
        k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(device, dtype)
        positions = torch.randint(0, seq, (batch, rows), generator=g)
        positions[0, 0] = -1
        valid = torch.rand(batch, seq, generator=g) > 0.2
        slots = torch.randint(0, seq, (batch, visual), generator=g)
        slots[-1, -1] = -1
        args = [t.to(device) for t in (positions, valid, slots)]
        got = visual_attention_triton(q, k, *args, dim ** -0.5)
        want = visual_attention_reference(q, k, *args, dim ** -0.5)
        assert got.shape == want.shape == (batch, rows, visual), got.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    print("kernel ok")
    """
)


def test_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", CHECK.format(device="cpu")], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_on_cuda():
    exec(CHECK.format(device="cuda"), {})


# --------------------------------------------------------------------------- DART's greedy picks
def test_greedy_picks_equal_a_loop_over_pivots():
    """`vtoken::greedy_least_similar` against plain Python: each pivot takes its least similar pool tokens (ties to
    the lower index), which leave the pool."""
    from vtoken.kernels import greedy_least_similar

    g = torch.Generator().manual_seed(3)
    similarity = torch.randint(0, 5, (2, 3, 12), generator=g).float()  # many ties
    pool = torch.rand(2, 12, generator=g) > 0.2
    takes = torch.tensor([[2, 3, 1], [4, 0, 2]])
    with count_launches() as counted:
        got = greedy_least_similar(similarity, pool, takes)
    assert counted.ops == {"vtoken::greedy_least_similar": 1} and counted.syncs == 0
    for b in range(2):
        left, kept = [j for j in range(12) if pool[b, j]], set()
        for p in range(3):
            taken = sorted(left, key=lambda j: (float(similarity[b, p, j]), j))[: int(takes[b, p])]
            kept |= set(taken)
            left = [j for j in left if j not in taken]
        assert got[b].nonzero().squeeze(1).tolist() == sorted(kept)


GREEDY = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import greedy_least_similar_reference, greedy_least_similar_triton
    device = "{device}"
    g = torch.Generator().manual_seed(0)
    for batch, steps, length in [(2, 8, 100), (1, 3, 7)]:
        similarity = torch.randint(0, 9, (batch, steps, length), generator=g).float().to(device)
        pool = (torch.rand(batch, length, generator=g) > 0.3).to(device)
        takes = torch.randint(0, 4, (batch, steps), generator=g).to(device)
        got = greedy_least_similar_triton(similarity, pool, takes)
        assert torch.equal(got, greedy_least_similar_reference(similarity, pool, takes))
    print("kernel ok")
    """
)


def test_greedy_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", GREEDY.format(device="cpu")], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_kernel_matches_reference_on_cuda():
    exec(GREEDY.format(device="cuda"), {})


# --------------------------------------------------------------------------- rotary applied inside the op
def _rotary_inputs(batch, heads, kv_heads, rows, seq, dim, visual, dtype, shared_tables, seed=0):
    """Unrotated queries [B, S, H, d] and keys [B, S, Hkv, d], rotary tables as a Llama rotary makes them (cos/sin of
    position * inverse frequency, halves repeated), query rows (-1: missing), key padding, visual slots (-1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g).to(dtype)
    positions = torch.arange(seq)[None].expand(1 if shared_tables else batch, -1)
    if not shared_tables:  # a left-padded row numbered from its first real token
        positions = (positions - torch.arange(batch)[:, None] * 3).clamp(min=0)
    frequencies = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[..., None].float() * frequencies
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rows_ = torch.randint(seq // 2, seq, (batch, rows), generator=g)
    rows_[0, -1] = -1
    valid = torch.rand(batch, seq, generator=g) > 0.2
    slots = torch.randint(0, seq, (batch, visual), generator=g)
    slots[-1, -2:] = -1
    return q, k, cos, sin, rows_, valid, slots, dim**-0.5


ROTARY_SHAPES = [  # batch, heads, kv heads, rows, seq, dim, visual, dtype, one table for the batch
    (2, 4, 2, 3, 40, 8, 7, torch.float32, True),
    (2, 4, 4, 1, 33, 16, 20, torch.float32, False),
    (3, 6, 2, 5, 50, 12, 30, torch.float16, False),
    (1, 2, 1, 2, 17, 8, 5, torch.float16, True),
]


@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=str)
@pytest.mark.parametrize("rotate_keys", [True, False])
def test_rotary_op_equals_the_models_rotary_then_the_op(shape, rotate_keys):
    """`vtoken::rotary_visual_attention` equals what the probe did before it: the query rows gathered and rotated by
    transformers' own Llama `apply_rotary_pos_emb`, the keys rotated by it (or given rotated, as a cache holds
    them), then `visual_attention`; GQA, padding keys, missing rows and slots, one table for the batch or one per
    row, fp32 and fp16."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from vtoken.kernels import rotary_visual_attention

    q, k, cos, sin, rows, valid, slots, scale = _rotary_inputs(*shape)
    batch, heads, dim = q.shape[0], q.shape[2], q.shape[3]
    full_cos, full_sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    safe = rows.clamp(min=0)
    row_q = q.gather(1, safe[:, :, None, None].expand(-1, -1, heads, dim)).transpose(1, 2)
    row_cos, row_sin = (t.gather(1, safe[:, :, None].expand(-1, -1, dim)) for t in (full_cos, full_sin))
    row_q = apply_rotary_pos_emb(row_q, row_q, row_cos, row_sin)[0]
    rotated = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), full_cos, full_sin)[1]
    want = visual_attention_reference(row_q, rotated, rows, valid, slots, scale)
    keys = k.transpose(1, 2) if rotate_keys else rotated
    with count_launches() as counted:
        got = rotary_visual_attention(q, keys, cos, sin, rows, valid, slots, scale, rotate_keys)
    assert counted.ops == {"vtoken::rotary_visual_attention": 1} and counted.syncs == 0
    assert torch.equal(got, want)
    meta = [t.to("meta") for t in (q, keys, cos, sin, rows, valid, slots)]
    assert rotary_visual_attention(*meta, scale, rotate_keys).shape == want.shape


ROTARY_CHECK = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, "tests")
    from test_visual_attention_kernel import ROTARY_SHAPES, _rotary_inputs
    from vtoken.kernels import rotary_visual_attention_reference, rotary_visual_attention_triton
    device = "{device}"
    for shape in ROTARY_SHAPES:
        for rotate_keys in (True, False):
            q, k, cos, sin, rows, valid, slots, scale = _rotary_inputs(*shape)
            keys = k.transpose(1, 2)
            args = [t.to(device) for t in (q, keys, cos, sin, rows, valid, slots)]
            got = rotary_visual_attention_triton(*args, scale, rotate_keys)
            want = rotary_visual_attention_reference(*args, scale, rotate_keys)
            assert got.shape == want.shape, got.shape
            tolerance = dict(rtol=1e-4, atol=1e-6) if q.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
            torch.testing.assert_close(got, want, **tolerance)
    print("kernel ok")
    """
)


def test_rotary_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", ROTARY_CHECK.format(device="cpu")], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotary_kernel_matches_reference_on_cuda():
    exec(ROTARY_CHECK.format(device="cuda"), {})
