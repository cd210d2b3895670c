"""The video mergers' kernels against their PyTorch references: `vtoken::attention_column_mean` (HoliTom's signal)
and `vtoken::static_windows` (HoliTom's window search), on CPU through TRITON_INTERPRET=1 (a subprocess: the
interpreter is chosen before triton is imported) and natively on CUDA when a GPU is present; both are custom ops
(one launch, `meta` tensors, their CPU implementation the reference)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vtoken.kernels import attention_column_mean, attention_column_mean_reference, fill_gaps, static_windows
from vtoken.launches import count_launches

COLUMNS = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import attention_column_mean_reference, attention_column_mean_triton
    device = "{device}"
    for batch, seq, heads, dim, dtype in [(2, 37, 3, 8, torch.float32), (1, 130, 2, 24, torch.float16),
                                          (3, 5, 1, 16, torch.float32)]:
        g = torch.Generator().manual_seed(seq)
        # strided: q and k are views into one fused qkv buffer, as in Qwen-VL towers
        qkv = torch.randn(batch, seq, 3, heads, dim, generator=g).to(device, dtype)
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        got = attention_column_mean_triton(q, k, dim ** -0.5)
        want = attention_column_mean_reference(q, k, dim ** -0.5)
        assert got.shape == want.shape == (batch, seq), got.shape
        torch.testing.assert_close(got, want, rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)
        torch.testing.assert_close(got.sum(-1), torch.ones(batch, device=device), rtol=1e-4, atol=1e-4)
    print("kernel ok")
    """
)

WINDOWS = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import static_windows_reference, static_windows_triton
    device = "{device}"
    g = torch.Generator().manual_seed(0)
    for batch, frames, max_window in [(3, 9, 1024), (2, 6, 3), (1, 1, 1024), (2, 17, 4), (1, 33, 1024)]:
        span = (torch.arange(frames)[None, :] - torch.arange(frames)[:, None]).clamp(min=0)
        gain = (torch.randint(0, 4, (batch, frames, frames), generator=g) * span).float().to(device)
        start, removed = static_windows_triton(gain, max_window)
        want_start, want_removed = static_windows_reference(gain, max_window)
        assert torch.equal(start.cpu(), want_start.cpu()) and torch.equal(removed.cpu(), want_removed.cpu())
    print("kernel ok")
    """
)

GAPS = textwrap.dedent(
    """
    import torch
    from vtoken.kernels import fill_gaps_reference, fill_gaps_triton
    device = "{device}"
    g = torch.Generator().manual_seed(0)
    for batch, frames in [(4, 1), (5, 7), (3, 33)]:
        labels = torch.randint(0, max(1, frames // 3), (batch, frames), generator=g)
        kept = torch.rand(batch, frames, generator=g) < 0.5
        length = torch.randint(0, 4, (batch, frames), generator=g)
        after = torch.randint(0, 5, (batch, frames), generator=g)
        args = [t.to(device) for t in (labels, kept, length, after)]
        assert torch.equal(fill_gaps_triton(*args).cpu(), fill_gaps_reference(*args).cpu())
    print("kernel ok")
    """
)

CHECKS = {"attention_column_mean": COLUMNS, "static_windows": WINDOWS, "fill_gaps": GAPS}


@pytest.mark.parametrize("kernel", CHECKS)
def test_kernel_matches_reference_under_interpreter(kernel):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-c", CHECKS[kernel].format(device="cpu")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", CHECKS)
def test_kernel_matches_reference_on_cuda(kernel):
    pytest.importorskip("triton")
    exec(CHECKS[kernel].format(device="cuda"), {})


def test_they_are_custom_ops_of_one_launch_with_meta_shapes():
    q, gain, labels = torch.randn(2, 9, 2, 4), torch.zeros(3, 5, 5), torch.zeros(2, 6, dtype=torch.long)
    kept = labels > 0
    with count_launches() as counted:
        columns = attention_column_mean(q, q, 0.5)
        start, removed = static_windows(gain, 1024)
        filled = fill_gaps(labels, kept, labels, labels)
    assert counted.kernels == 3 and counted.syncs == 0, counted.describe()
    assert set(counted.ops) == {"vtoken::attention_column_mean", "vtoken::static_windows", "vtoken::fill_gaps"}
    assert torch.equal(filled, labels)
    assert torch.equal(columns, attention_column_mean_reference(q, q, 0.5))
    assert start.tolist() == [[0, 1, 2, 3, 4]] * 3 and removed.tolist() == [0.0] * 3  # no gain: one-frame windows
    meta = torch.empty(2, 9, 2, 4, device="meta")
    assert attention_column_mean(meta, meta, 0.5).shape == (2, 9)
    start, removed = static_windows(torch.empty(3, 5, 5, device="meta"), 8)
    on_meta = torch.empty(2, 6, dtype=torch.long, device="meta")
    assert fill_gaps(on_meta, on_meta > 0, on_meta, on_meta).shape == (2, 6)
    assert start.shape == (3, 5) and start.dtype == torch.long and removed.shape == (3,)


def test_column_mean_equals_the_eager_attention_map():
    """The mean over heads and query rows of softmax(q k^T * scale), as eager attention would give it."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 11, 3, 5, generator=g), torch.randn(2, 11, 3, 5, generator=g)
    maps = torch.einsum("bihd,bjhd->bhij", q, k).mul(0.4).softmax(-1)
    torch.testing.assert_close(attention_column_mean(q, k, 0.4), maps.mean((1, 2)))
