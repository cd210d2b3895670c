"""The block-sparse attention kernel against its PyTorch reference (on CPU through TRITON_INTERPRET=1, set in a
subprocess since the interpreter must be chosen before triton is imported; natively on CUDA when present), and
the reference against dense SDPA with the equivalent boolean mask built here block by block."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from vtoken.kernels import block_sparse_attention_reference

pytest.importorskip("triton")

# random plans: each query block lists a random subset of its causal key blocks, in random order, and the slots
# past its count hold other in-range blocks (if the kernel read them, the result would change)
PLANS = textwrap.dedent(
    """
    import torch

    def random_plan(batch, heads, seq, block, density, g):
        blocks = -(-seq // block)
        counts = torch.zeros(batch, heads, blocks, dtype=torch.int32)
        index = torch.zeros(batch, heads, blocks, blocks, dtype=torch.int32)
        for b in range(batch):
            for h in range(heads):
                for qb in range(blocks):
                    chosen = [kb for kb in range(qb + 1) if torch.rand(1, generator=g).item() < density]
                    order = torch.randperm(len(chosen), generator=g).tolist()
                    chosen = [chosen[i] for i in order]
                    rest = [kb for kb in range(blocks) if kb not in chosen]
                    counts[b, h, qb] = len(chosen)
                    index[b, h, qb] = torch.tensor(chosen + rest, dtype=torch.int32)
        return counts, index

    def full_plan(batch, heads, seq, block):
        blocks = -(-seq // block)
        counts = torch.arange(1, blocks + 1, dtype=torch.int32).expand(batch, heads, blocks).contiguous()
        index = torch.arange(blocks, dtype=torch.int32).expand(batch, heads, blocks, blocks).contiguous()
        return counts, index
    """
)

CHECK = PLANS + textwrap.dedent(
    """
    import torch.nn.functional as F
    from vtoken.kernels import block_sparse_attention_reference, block_sparse_attention_triton
    device = "{device}"
    dtypes = {dtypes}
    cases = [  # batch, heads, kv_heads, seq, dim, block, density, padded, sink, window
        (2, 4, 2, 100, 16, 32, 0.5, False, 0, 0),    # not a multiple of the block, GQA 2
        (1, 4, 2, 300, 16, 128, 0.7, True, 3, 150),  # block 128: key tiles of 64
        (1, 4, 1, 77, 24, 16, 0.6, True, 0, 0),      # GQA 4, padding, head dim not a power of two
        (2, 4, 1, 70, 16, 16, 0.5, True, 5, 20),     # GQA 4, padding, element-level A-shape limits
        (1, 2, 2, 1, 16, 16, 1.0, False, 0, 0),      # one row
        (1, 2, 2, 40, 32, 16, 0.0, False, 0, 0),     # nothing listed: every row gives 0
    ]
    for dtype in dtypes:
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for batch, heads, kv_heads, seq, dim, block, density, padded, sink, window in cases:
            g = torch.Generator().manual_seed(seq)
            q = torch.randn(batch, heads, seq, dim, generator=g).to(device, dtype)
            k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(device, dtype)
            v = torch.randn(batch, kv_heads, seq, dim, generator=g).to(device, dtype)
            valid = None
            if padded:
                valid = torch.rand(batch, seq, generator=g) > 0.25
                valid[0, : seq // 3] = False  # left padding: the first rows of sample 0 see no key
                valid = valid.to(device)
            counts, index = random_plan(batch, heads, seq, block, density, g)
            counts, index = counts.to(device), index.to(device)
            args = (q, k, v, counts, index, block, dim ** -0.5, valid, sink, window)
            got = block_sparse_attention_triton(*args)
            want = block_sparse_attention_reference(*args)
            assert got.shape == want.shape == q.shape and got.dtype == dtype, (got.shape, got.dtype)
            torch.testing.assert_close(got.float(), want.float(), **tol)
        # the full causal plan is plain causal attention
        for batch, heads, kv_heads, seq, dim, block in [(2, 4, 2, 90, 16, 32), (1, 4, 1, 50, 32, 16)]:
            g = torch.Generator().manual_seed(seq)
            q, k, v = (torch.randn(batch, h, seq, dim, generator=g).to(device, dtype)
                       for h in (heads, kv_heads, kv_heads))
            counts, index = full_plan(batch, heads, seq, block)
            got = block_sparse_attention_triton(q, k, v, counts.to(device), index.to(device), block, dim ** -0.5)
            rep = heads // kv_heads
            want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                                  v.float().repeat_interleave(rep, 1), is_causal=True)
            torch.testing.assert_close(got.float(), want, **tol)
    print("kernel ok")
    """
)


def test_kernel_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = CHECK.format(device="cpu", dtypes="[torch.float32, torch.float16]")  # bf16 tl.dot is wrong here
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_on_cuda():
    exec(CHECK.format(device="cuda", dtypes="[torch.float32, torch.float16, torch.bfloat16]"), {})


def blockwise_mask(counts, index, block, seq, valid, sink, window):
    """[B, H, S, S] bool built from Python sets of listed blocks, independently of the kernels module."""
    batch, heads, blocks = counts.shape
    mask = torch.zeros(batch, heads, seq, seq, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for qb in range(blocks):
                for kb in set(index[b, h, qb, : counts[b, h, qb]].tolist()):
                    mask[b, h, qb * block : (qb + 1) * block, kb * block : (kb + 1) * block] = True
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    mask &= j <= i
    if window > 0:
        mask &= (j < sink) | (i - j < window)
    if valid is not None:
        mask &= valid[:, None, None, :]
    return mask


@pytest.mark.parametrize("padded, sink, window", [(False, 0, 0), (True, 0, 0), (True, 3, 17)])
def test_reference_equals_sdpa_with_the_equivalent_mask(padded, sink, window):
    namespace: dict = {}
    exec(PLANS, namespace)
    g = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, seq, dim, block = 2, 4, 2, 90, 8, 16
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=g) for _ in range(2))
    valid = (torch.rand(batch, seq, generator=g) > 0.3) if padded else None
    if padded:
        valid[1, :40] = False
    counts, index = namespace["random_plan"](batch, heads, seq, block, 0.5, g)
    got = block_sparse_attention_reference(q, k, v, counts, index, block, dim**-0.5, valid, sink, window)
    mask = blockwise_mask(counts, index, block, seq, valid, sink, window)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    seen = mask.any(-1)
    assert seen.any() and (~seen).any()  # the plan leaves some rows without keys
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))


IN_MODEL = textwrap.dedent(
    """
    import torch
    import vtoken
    from vtoken.zoo import build_prompt, tiny_llava
    from vtoken.images import example_image
    torch.set_num_threads(1)
    model, processor = tiny_llava(image_size=224, text_layers=1)  # 256 visual tokens
    inputs = processor(images=[example_image(224)] * 2, text=[build_prompt(processor, "what is it?"),
                       build_prompt(processor, "what is in this image? answer")], return_tensors="pt", padding=True)
    outputs = {}
    for backend in ("torch", "triton"):
        method = vtoken.SparsePrefill(density=0.3, block_size=32, min_length=16, backend=backend)
        with torch.no_grad(), vtoken.patched(model, method) as handle:
            outputs[backend] = model(**inputs).logits
            assert [r.stage for r in handle.records] == ["sparse.layer0"] * 2, handle.records
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-4, atol=1e-4)
    print("model ok")
    """
)


def test_triton_backend_inside_a_model_under_interpreter():
    """The kernel path of the integration (aligned padded rows, GQA 2) matches the torch path on a padded batch."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", IN_MODEL], env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model ok" in result.stdout


def _compile_for_h100(dtype: str, padded: bool, block: int, config: dict):
    """The kernel compiled ahead of time for sm_90 (ptxas ships with triton) with one tile configuration."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = importlib.import_module("vtoken.kernels.block_sparse_attention")._block_sparse_kernel
    pointers = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], f"*{dtype}")
    pointers.update(counts_ptr="*i32", index_ptr="*i32", valid_ptr="*i8" if padded else "*i32", scale="fp32")
    constexprs = dict(HAS_VALID=padded, BLOCK=block, BLOCK_D=128, PRECISION="ieee" if dtype == "fp32" else "tf32",
                      BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], PIPELINE=config["PIPELINE"])  # fmt: skip
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize(
    "dtype, padded, block, block_m, block_n",
    [
        ("bf16", False, 64, 128, 64),
        ("bf16", True, 128, 64, 64),
        ("fp32", True, 16, 128, 16),
        ("fp16", False, 256, 128, 64),
    ],
)
def test_kernel_compiles_for_h100_without_a_gpu(dtype, padded, block, block_m, block_n):
    """The interpreter does not check what the compiler rejects: compile ahead of time for sm_90, so a kernel that
    only runs interpreted cannot pass; merged 128-row tiles (plan block 64 and 16), tiles inside a plan block (128,
    256), and the block loop software-pipelined (asynchronous copies in flight while a tile computes)."""
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, PIPELINE=3, num_warps=8 if block_m == 128 else 4, num_stages=3)
    compiled = _compile_for_h100(dtype, padded, block, config)
    assert compiled.asm["cubin"]
    assert "async_copy_global_to_local" in compiled.asm["ttgir"]  # K/V tiles prefetched by the pipeline


@pytest.mark.parametrize("block", [64, 128])
def test_every_autotuned_config_compiles_for_h100(block):
    """What the autotuner may pick on a GPU at Qwen2.5-VL's shape (bf16, head dim 128) compiles for sm_90."""
    from vtoken.kernels.block_sparse_attention import CONFIGS, _fitting

    kept = _fitting(CONFIGS, {"head_dim": 128}, BLOCK=block)
    assert {c.kwargs["BLOCK_M"] for c in kept} == ({128} if block == 64 else {64, 128})
    for c in kept:
        config = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        assert _compile_for_h100("bf16", True, block, config).asm["cubin"], config


# every tile shape the launcher accepts, under the interpreter: tiles of one plan block (or inside a coarser one),
# merged 128-row tiles over 2, 4 and 8 plan rows, key steps below the block, pipeline depths; GQA groups of 1-4
# (3 is not a power of two), lengths that are not multiples of anything, padding, A-shape limits, empty plan rows
CONFIG_CHECK = PLANS + textwrap.dedent(
    """
    import torch
    from vtoken.kernels.block_sparse_attention import block_sparse_attention_reference, launch
    device = "{device}"
    cases = [  # batch, heads, kv_heads, seq, dim, block, density, padded, sink, window, configs (M, N, pipeline)
        (2, 6, 2, 150, 16, 64, 0.6, True, 0, 0, [(64, 64, 2), (64, 32, 3), (128, 64, 3), (128, 32, 2)]),
        (1, 4, 4, 200, 16, 32, 0.5, False, 5, 45, [(32, 32, 2), (32, 16, 4), (128, 32, 3)]),
        (1, 4, 1, 130, 24, 16, 0.5, True, 0, 0, [(16, 16, 2), (128, 16, 3)]),
        (1, 2, 1, 300, 16, 256, 0.8, True, 3, 100, [(64, 64, 2), (128, 64, 3), (128, 128, 2)]),
        (1, 4, 2, 129, 16, 128, 0.6, False, 0, 0, [(64, 32, 2), (128, 64, 2)]),
        (1, 2, 2, 100, 16, 64, 0.0, False, 0, 0, [(64, 64, 2), (128, 64, 2)]),
    ]
    for dtype in (torch.float32, torch.float16):
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for batch, heads, kv_heads, seq, dim, block, density, padded, sink, window, configs in cases:
            g = torch.Generator().manual_seed(seq)
            q = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
            k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(dtype)
            v = torch.randn(batch, kv_heads, seq, dim, generator=g).to(dtype)
            valid = None
            if padded:
                valid = torch.rand(batch, seq, generator=g) > 0.25
                valid[0, : seq // 3] = False  # the first rows see no key
            counts, index = random_plan(batch, heads, seq, block, density, g)
            args = [x.to(device) if x is not None else None for x in (q, k, v, counts, index)]
            args += [block, dim ** -0.5, valid.to(device) if padded else None, sink, window]
            want = block_sparse_attention_reference(*args)
            for block_m, block_n, pipeline in configs:
                config = dict(BLOCK_M=block_m, BLOCK_N=block_n, PIPELINE=pipeline, num_warps=4, num_stages=pipeline)
                got = launch(*args, config)
                assert got.dtype == dtype and got.shape == q.shape
                torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m, c=config: str(c) + ": " + m)
    print("configs ok")
    """
)


def test_every_tile_configuration_matches_the_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = CONFIG_CHECK.format(device="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "configs ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_tile_configuration_matches_the_reference_on_cuda():
    exec(CONFIG_CHECK.format(device="cuda"), {})


def test_a_config_the_plan_cannot_serve_is_refused():
    from vtoken.kernels.block_sparse_attention import launch

    q = torch.zeros(1, 1, 64, 16)
    counts, index = torch.ones(1, 1, 4, dtype=torch.int32), torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="query tiles"):
        launch(q, q, q, counts, index, 16, 1.0, None, 0, 0, dict(BLOCK_M=64, BLOCK_N=16, PIPELINE=2, num_warps=4,
                                                                 num_stages=2))  # fmt: skip


def test_tile_plan_merges_rows_exactly():
    """Each merged entry lists a block once, ascending, flagged with exactly the plan rows that listed it."""
    from vtoken.kernels.block_sparse_attention import tile_plan

    namespace: dict = {}
    exec(PLANS, namespace)
    g = torch.Generator().manual_seed(3)
    for block, rows in [(64, 2), (32, 4), (16, 8)]:
        counts, index = namespace["random_plan"](2, 3, 500, block, 0.4, g)
        tile_counts, entries = tile_plan(counts, index, rows)
        qb = counts.shape[-1]
        assert tile_counts.shape == (2, 3, -(-qb // rows))
        for b in range(2):
            for h in range(3):
                for t in range(tile_counts.shape[-1]):
                    got = entries[b, h, t, : tile_counts[b, h, t]].tolist()
                    blocks = [e >> 8 for e in got]
                    assert blocks == sorted(set(blocks))
                    for r in range(rows):
                        if t * rows + r < qb:
                            want = set(index[b, h, t * rows + r, : counts[b, h, t * rows + r]].tolist())
                            assert {e >> 8 for e in got if e >> r & 1} == want


def test_the_custom_op_is_one_launch_and_traces():
    """`block_sparse_attention` is the custom op vtoken::block_sparse_attention: one launch to a counter, a fake
    implementation for meta tensors, and no graph break under torch.compile."""
    from vtoken.kernels import block_sparse_attention
    from vtoken.launches import count_launches

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16)
    namespace: dict = {}
    exec(PLANS, namespace)
    counts, index = namespace["random_plan"](1, 4, 40, 16, 0.7, g)
    with count_launches() as counted:
        out = block_sparse_attention(q, k, v, counts, index, 16, 0.25)
    assert counted.kernels == 1 and counted.syncs == 0, counted.describe()
    assert list(counted.ops) == ["vtoken::block_sparse_attention"]
    torch.testing.assert_close(out, block_sparse_attention_reference(q, k, v, counts, index, 16, 0.25))
    meta = block_sparse_attention(*(x.to("meta") for x in (q, k, v, counts, index)), 16, 0.25)
    assert meta.shape == q.shape and meta.device.type == "meta"
    compiled = torch.compile(lambda *a: block_sparse_attention(*a, 16, 0.25), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, counts, index), out)


LINE_SUMS = textwrap.dedent(
    """
    import torch
    from vtoken.kernels.line_sums import line_sums_reference, line_sums_triton
    from vtoken.methods.sparse_prefill import estimate_rows
    device = "{device}"
    for batch, heads, kv_heads, seq, dim, padded, dtype in [(2, 4, 2, 300, 16, True, torch.float32),
            (1, 6, 2, 70, 24, False, torch.float32), (2, 2, 2, 150, 32, True, torch.float16),
            (1, 2, 1, 5, 16, False, torch.float32)]:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
        k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(dtype)
        valid = torch.ones(batch, seq, dtype=torch.bool)
        if padded:
            valid = torch.rand(batch, seq, generator=g) > 0.25
            valid[0, : seq // 3] = False
        q, k, valid = q.to(device), k.to(device), valid.to(device)
        rows = estimate_rows(valid if padded else None, batch, seq, device)
        q_rows = q.gather(2, rows[:, None, :, None].expand(-1, heads, -1, dim))
        want = line_sums_reference(q_rows, k, rows, valid, dim ** -0.5)
        got = line_sums_triton(q_rows, k, rows, valid, dim ** -0.5)
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
    print("line sums ok")
    """
)


def test_line_sums_kernel_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = LINE_SUMS.format(device="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "line sums ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_line_sums_kernel_matches_reference_on_cuda():
    exec(LINE_SUMS.format(device="cuda"), {})


def test_line_sums_reference_sums_columns_and_diagonals():
    """Independently of the kernels module: vertical[j] = mean over rows of p[r, j]; slash[o] = mean over rows of
    p[r, rows[r] - o], from a hand-made probability table."""
    from vtoken.kernels.line_sums import line_sums_reference

    g = torch.Generator().manual_seed(1)
    seq, dim = 12, 4
    q_rows, k = torch.randn(1, 1, 3, dim, generator=g), torch.randn(1, 1, seq, dim, generator=g)
    rows = torch.tensor([[5, 9, 11]])
    valid = torch.ones(1, seq, dtype=torch.bool)
    valid[0, 2] = False
    vertical, slash = line_sums_reference(q_rows, k, rows, valid, 0.5)
    probs = torch.zeros(3, seq)
    for r, position in enumerate(rows[0].tolist()):
        seen = [j for j in range(position + 1) if j != 2]
        logits = (q_rows[0, 0, r] @ k[0, 0, seen].T) * 0.5
        probs[r, seen] = logits.softmax(-1)
    want_slash = torch.zeros(seq)
    for r, position in enumerate(rows[0].tolist()):
        for o in range(position + 1):
            want_slash[o] += probs[r, position - o]
    torch.testing.assert_close(vertical[0, 0], probs.mean(0))
    torch.testing.assert_close(slash[0, 0], want_slash / 3)


def test_flex_attention_matches_the_reference_on_cpu():
    """The FlexAttention backend (compiled by inductor's CPU backend) against the reference: GQA, ragged lengths,
    padding with rows that see nothing, the A-shape's element limits, an empty plan; one length bucket (one
    compilation), so the case stays quick."""
    from vtoken.kernels.block_sparse_flex import block_sparse_attention_flex, bucket, flex_unavailable

    if flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    namespace: dict = {}
    exec(PLANS, namespace)
    assert bucket(100, 32) == bucket(110, 32) == bucket(128, 32) == 128
    cases = [(100, 0.5, False, 0, 0), (110, 0.6, True, 3, 40), (128, 0.0, False, 0, 0), (97, 1.0, True, 0, 0)]
    for seq, density, padded, sink, window in cases:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(2, 4, seq, 16, generator=g)
        k, v = torch.randn(2, 2, seq, 16, generator=g), torch.randn(2, 2, seq, 16, generator=g)
        valid = None
        if padded:
            valid = torch.rand(2, seq, generator=g) > 0.25
            valid[0, : seq // 3] = False
        counts, index = namespace["random_plan"](2, 4, seq, 32, density, g)
        args = (q, k, v, counts, index, 32, 0.25, valid, sink, window)
        got = block_sparse_attention_flex(*args)
        want = block_sparse_attention_reference(*args)
        assert got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_makes_no_host_copy():
    """A layer's `BlockMask` is built on the device from the plan: the A-shape's sink and window enter the mask
    as Python ints (kernel constants), not as tensors copied from the host on every layer of every call."""
    from vtoken.kernels.block_sparse_flex import flex_block_mask, flex_unavailable
    from vtoken.launches import count_launches

    if flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    namespace: dict = {}
    exec(PLANS, namespace)
    g = torch.Generator().manual_seed(0)
    counts, index = namespace["random_plan"](2, 4, 256, 32, 0.5, g)
    valid = torch.rand(2, 256, generator=g) > 0.2
    for sink, window in ((0, 0), (3, 40)):
        with count_launches() as counted:
            flex_block_mask(counts, index, 32, 256, valid, sink, window)
        assert counted.syncs == 0, counted.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_matches_the_reference_on_cuda():
    from vtoken.kernels.block_sparse_flex import block_sparse_attention_flex

    namespace: dict = {}
    exec(PLANS, namespace)
    for dtype, block in [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 32)]:
        g = torch.Generator().manual_seed(block)
        q = torch.randn(1, 28, 700, 128, generator=g).to("cuda", dtype)
        k, v = (torch.randn(1, 4, 700, 128, generator=g).to("cuda", dtype) for _ in range(2))
        valid = (torch.rand(1, 700, generator=g) > 0.1).cuda()
        counts, index = namespace["random_plan"](1, 28, 700, block, 0.3, g)
        args = (q, k, v, counts.cuda(), index.cuda(), block, 128**-0.5, valid, 4, 300)
        torch.testing.assert_close(
            block_sparse_attention_flex(*args).float(), block_sparse_attention_reference(*args).float(),
            rtol=2e-2, atol=2e-2,
        )  # fmt: skip


def test_line_sums_kernels_compile_for_h100_without_a_gpu():
    """The estimate's three kernels at Qwen2.5-VL's shape (bf16, head dim 128, 64 rows) compile for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vtoken.kernels import line_sums

    def compile_for_h100(kernel, pointers, floats, constexprs):
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats else "i32")
                     for n in kernel.arg_names}  # fmt: skip
        constants = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})

    rows = dict(q_ptr="*bf16", k_ptr="*bf16", rows_ptr="*i64", valid_ptr="*i8")
    tiles = dict(BLOCK_R=64, BLOCK_D=128, PRECISION="tf32", BLOCK_N=64)
    lse = dict(rows, max_ptr="*fp32", sum_ptr="*fp32")
    probs = dict(rows, lse_ptr="*fp32", probs_ptr="*fp32", vertical_ptr="*fp32")
    slash = dict(probs_ptr="*fp32", rows_ptr="*i64", slash_ptr="*fp32")
    assert compile_for_h100(line_sums._rows_lse_kernel, lse, {"scale"}, dict(tiles, CHUNK_KEYS=4096)).asm["cubin"]
    assert compile_for_h100(line_sums._rows_probs_kernel, probs, {"scale"}, tiles).asm["cubin"]
    assert compile_for_h100(line_sums._slash_kernel, slash, set(), dict(BLOCK_O=256)).asm["cubin"]
