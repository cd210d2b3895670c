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


@pytest.mark.parametrize("dtype, padded, block", [("bf16", False, 64), ("bf16", True, 128), ("fp32", True, 16)])
def test_kernel_compiles_for_h100_without_a_gpu(dtype, padded, block):
    """The interpreter does not check what the compiler rejects: compile ahead of time for sm_90 (ptxas ships with
    triton), so a kernel that only runs interpreted cannot pass."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = importlib.import_module("vtoken.kernels.block_sparse_attention")._block_sparse_kernel
    pointers = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], f"*{dtype}")
    pointers.update(counts_ptr="*i32", index_ptr="*i32", valid_ptr="*i8" if padded else "*i32", scale="fp32")
    constexprs = dict(HAS_VALID=padded, BLOCK=block, BLOCK_N=min(block, 64), BLOCK_D=128,
                      PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    options = {"num_warps": 4 if block <= 64 else 8, "num_stages": 2}  # as the launcher sets them
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"]
