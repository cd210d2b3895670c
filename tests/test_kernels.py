"""Triton kernels against their PyTorch references: on CPU through TRITON_INTERPRET=1 (set in a subprocess,
since the interpreter must be chosen before triton is imported), natively on CUDA when a GPU is present."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import attention_row_probs_reference, attention_row_probs_triton
    device = "{device}"
    for batch, heads, seq, dim, dtype, strided in [(2, 4, 577, 16, torch.float32, False),
                                                  (1, 3, 130, 24, torch.float16, True),
                                                  (3, 1, 5, 8, torch.float32, True)]:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
        # strided: keys are a view into a wider projection output, as when k shares a fused qkv buffer
        k_full = torch.randn(batch, seq, 2 if strided else 1, heads, dim, generator=g).to(device, dtype)
        k = k_full[:, :, 0]
        scale = dim ** -0.5
        got = attention_row_probs_triton(q, k, scale)
        want = attention_row_probs_reference(q, k, scale)
        assert got.shape == want.shape == (batch, heads, seq), got.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.sum(-1), torch.ones(batch, heads, device=device), rtol=1e-5, atol=1e-5)
        # a padded batch: keys outside key_valid get no probability (the [CLS] key of every row stays valid)
        valid = torch.rand(batch, seq, generator=g) > 0.3
        valid[:, 0] = True
        valid = valid.to(device)
        got = attention_row_probs_triton(q, k, scale, valid)
        want = attention_row_probs_reference(q, k, scale, valid)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert (got[~valid[:, None, :].expand_as(got)] == 0).all()
        logits = (q.float()[:, None] * k.float()).sum(-1).transpose(1, 2) * scale  # independently: a masked softmax
        expected = logits.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.ops.vtoken.attention_row_probs(q, k, scale, valid), want, rtol=1e-4, atol=1e-6)
    print("kernel ok")
    """
)


CHECK_ROWS = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import causal_rows_probs_reference, causal_rows_probs_triton
    device = "{device}"
    for batch, heads, kv_heads, rows, seq, dim, dtype in [(2, 4, 2, 3, 300, 16, torch.float32),
                                                           (1, 3, 3, 1, 130, 24, torch.float16),
                                                           (2, 2, 1, 2, 7, 8, torch.float32)]:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(batch, heads, rows, dim, generator=g).to(device, dtype)
        k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(device, dtype)
        positions = torch.randint(0, seq, (batch, rows), generator=g).to(device)
        valid = (torch.rand(batch, seq, generator=g) > 0.2).to(device)
        valid[0, : positions[0].max() + 1] = False  # row(s) of sample 0 see no key at all: all zeros
        scale = dim ** -0.5
        got = causal_rows_probs_triton(q, k, positions, valid, scale)
        want = causal_rows_probs_reference(q, k, positions, valid, scale)
        assert got.shape == want.shape == (batch, heads, rows, seq), got.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        seen = (torch.arange(seq, device=device) <= positions[:, :, None]) & valid[:, None]
        assert torch.equal(got.sum(-1) > 0.5, seen.any(-1)[:, None].expand(-1, heads, -1))
    print("kernel ok")
    """
)

CHECK_DPP = textwrap.dedent(
    """
    import torch
    import vtoken.kernels.dpp as dpp
    device = "{device}"
    # (crops, tokens, width, steps, rows from the features): widths below the steps exhaust the rank
    for crops, n, dim, steps, from_features in [(2, 70, 8, 20, False), (3, 41, 24, 35, False), (2, 50, 6, 12, True),
                                                (1, 300, 16, 40, False)]:
        g = torch.Generator().manual_seed(n)
        unit = torch.nn.functional.normalize(torch.randn(crops, n, dim, generator=g), dim=-1).to(device)
        unit[0, 5] = unit[0, 2]  # a duplicate adds nothing
        quality = torch.rand(crops, n, generator=g).to(device)
        candidates = (torch.rand(crops, n, generator=g) > 0.2).to(device)
        limit, dpp.MATRIX_LIMIT = dpp.MATRIX_LIMIT, (10 if from_features else dpp.MATRIX_LIMIT)
        try:
            got = dpp.dpp_greedy_triton(unit, quality, candidates, steps, 1e-4)
        finally:
            dpp.MATRIX_LIMIT = limit
        want = dpp.dpp_greedy_reference(unit, quality, candidates, steps, 1e-4)
        assert torch.equal(got, want), (got, want)
        assert (want[:, -1] == -1).all() or dim >= steps  # past the rank: -1
        assert torch.equal(torch.ops.vtoken.dpp_greedy(unit, quality, candidates, steps, 1e-4), want)
    print("kernel ok")
    """
)

CHECKS = {"row_probs": CHECK, "causal_rows": CHECK_ROWS, "dpp_greedy": CHECK_DPP}


@pytest.mark.parametrize("kernel", CHECKS)
def test_kernel_matches_reference_under_interpreter(kernel):
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-c", CHECKS[kernel].format(device="cpu")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", CHECKS)
def test_kernel_matches_reference_on_cuda(kernel):
    exec(CHECKS[kernel].format(device="cuda"), {})
