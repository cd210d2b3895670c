"""The greedy selections' Triton kernels (DivPrune's max-min diversity, MMTok's max coverage, VisPruner's duplicate
removal, the exact-fp32 Gram matrix they read) against their PyTorch references: on CPU through TRITON_INTERPRET=1
(a subprocess, since the interpreter is chosen before triton is imported; small shapes, blocks shrunk so that every
chunk loop runs more than once), natively on CUDA when a GPU is present. Cases: ties (the first index wins),
k = 1, k = N, padded and invalid tokens, several crops in one launch. Then the custom ops themselves: registered
in the `vtoken` namespace, one launch to a counter, shapes on the meta device."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vtoken.kernels import (
    duplicate_removal,
    duplicate_removal_reference,
    greedy_max_coverage,
    greedy_weighted_coverage,
    greedy_weighted_coverage_reference,
    max_min_diversity,
    max_min_diversity_reference,
)
from vtoken.launches import count_launches

pytest.importorskip("triton")

GRAM = """
import torch
from vtoken.kernels import gram_reference, gram_triton
from vtoken.kernels import gram as module
device = "{device}"
g = torch.Generator().manual_seed(0)
for batch, length, dim in [(2, 70, 40), (1, 1, 3), (3, 33, 64)]:
    unit = torch.nn.functional.normalize(torch.randn(batch, length, dim, generator=g), dim=-1).to(device)
    got = gram_triton(unit)
    torch.testing.assert_close(got, gram_reference(unit), rtol=1e-5, atol=1e-6)
    assert torch.equal(got, got.transpose(1, 2)), "exactly symmetric"
print("kernel ok")
"""

DIVERSITY = """
import torch
from vtoken.kernels import diversity, max_min_diversity_reference, max_min_diversity_triton
diversity.MAX_BLOCK_L = {block}
device = "{device}"
g = torch.Generator().manual_seed(1)

def check(features, valid, counts, width):
    features, valid, counts = features.to(device), valid.to(device), torch.tensor(counts).to(device)
    want = max_min_diversity_reference(features, valid, counts, width)
    got = max_min_diversity_triton(features, valid, counts, width)
    assert torch.equal(got, want), (got.tolist(), want.tolist())

# several images in one launch, padded rows (a prefix valid) and scattered invalid tokens; k = 1, k = all, k = 0
features = torch.randn(4, 40, 16, generator=g)
valid = torch.ones(4, 40, dtype=torch.bool)
valid[1, 29:] = False
valid[2, ::3] = False
valid[3, 5:] = False
check(features, valid, [9, 29, 1, 5], 29)
check(features, valid, [1, 1, 26, 0], 26)
# ties: four unit vectors at right angles (every distance 1 or 2), and exact duplicates (distance 0)
square = torch.tensor([[[1.0, 0], [0, 1], [-1, 0], [0, -1]]])
for k in (1, 2, 3, 4):
    check(square, torch.ones(1, 4, dtype=torch.bool), [k], 4)
# two pairs of identical tokens: their rows of D are identical, so they tie exactly until one of a pair is picked
# (after that its twin's distance is rounding noise around 0: it goes last, and k stops before)
twins = torch.randn(1, 12, 6, generator=g)
twins[0, 7], twins[0, 10] = twins[0, 2], twins[0, 4]
for k in (1, 4, 7, 10):
    check(twins, torch.ones(1, 12, dtype=torch.bool), [k], 12)
# a single valid token, and an image without any
check(torch.randn(2, 5, 3, generator=g), torch.tensor([[True, False, False, False, False], [False] * 5]), [1, 0], 1)
print("kernel ok")
"""

COVERAGE = """
import torch
from vtoken.kernels import coverage, greedy_max_coverage_triton
from vtoken.kernels import greedy_weighted_coverage_reference, greedy_weighted_coverage_triton
coverage.BLOCK_N, coverage.BLOCK_R = {block}, {block}
device = "{device}"
g = torch.Generator().manual_seed(2)

def check(matrix, weight, excluded, counts, width, splits=None):
    matrix, excluded, counts = matrix.to(device), excluded.to(device), torch.tensor(counts).to(device)
    weight = None if weight is None else weight.to(device)
    want = greedy_weighted_coverage_reference(matrix, weight, excluded, counts, width)
    got = greedy_weighted_coverage_triton(matrix, weight, excluded, counts, width, splits)
    assert torch.equal(got, want), (got.tolist(), want.tolist())

# several crops, columns spread over several programs and rows over several chunks and programs (partial sums);
# excluded columns; k = 0, 1, N; unweighted (MMTok) and weighted (SCOPE), zero weights included
matrix = torch.rand(3, 50, 40, generator=g) ** 3
excluded = torch.zeros(3, 40, dtype=torch.bool)
excluded[1, 2] = True
excluded[2, 30:] = True
weight = torch.rand(3, 40, generator=g)
weight[0, 5:9] = 0.0
check(matrix, None, excluded, [7, 1, 0], 7, 1)
check(matrix, weight, excluded, [7, 1, 0], 7, 3)
check(matrix[:, :20, 22:], weight[:, 22:], excluded[:, 22:], [18, 17, 8], 18, 2)  # k = every valid column
# ties: equal columns (the first is picked), and columns that cover nothing once the rows are covered (then the
# lowest unpicked index); all weights 1 = MMTok's picks
ties = torch.rand(2, 9, 12, generator=g)
ties[:, :, 7] = ties[:, :, 2]
ties[1, :, 5] = ties[1, :, 9] = 0.0
check(ties, torch.ones(2, 12), torch.zeros(2, 12, dtype=torch.bool), [12, 6], 12, 2)
mmtok = greedy_max_coverage_triton(ties.to(device), torch.zeros(2, 12, dtype=torch.bool).to(device),
                                   torch.tensor([12, 6]).to(device), 12)  # fmt: skip
assert torch.equal(mmtok.cpu(), greedy_weighted_coverage_reference(ties, None, torch.zeros(2, 12, dtype=torch.bool),
                                                                   torch.tensor([12, 6]), 12))  # fmt: skip
print("kernel ok")
"""

DUPLICATES = """
import torch
from vtoken.kernels import duplicates, duplicate_removal_reference, duplicate_removal_triton
duplicates.MAX_BLOCK = {block}
device = "{device}"
g = torch.Generator().manual_seed(3)

def check(features, residual, lengths, keep, width):
    features, residual = features.to(device), residual.to(device)
    lengths, keep = torch.tensor(lengths).to(device), torch.tensor(keep).to(device)
    want = duplicate_removal_reference(features, residual, lengths, keep, width)
    got = duplicate_removal_triton(features, residual, lengths, keep, width)
    assert torch.equal(got, want), (got.tolist(), want.tolist())

# several crops, residuals of different lengths (odd ones too), rounds that drop fewer than 8, keep = 0 or all
n = 45
features = torch.randn(4, n, 8, generator=g)
residual = torch.stack([torch.randperm(n, generator=g) for _ in range(4)])
check(features, residual, [45, 30, 17, 44], [6, 1, 0, 44], 44)
check(features, residual, [45, 2, 3, 9], [30, 1, 1, 8], 30)
# ties: duplicated tokens give equal similarities (the earlier a-token goes first)
twins = torch.randn(1, 16, 4, generator=g)
twins[0, 8:] = twins[0, :8]
check(twins, torch.arange(16)[None], [16], [5], 5)
check(twins, torch.arange(15, -1, -1)[None], [16], [9], 9)
print("kernel ok")
"""

CHECKS = {"gram": GRAM, "diversity": DIVERSITY, "coverage": COVERAGE, "duplicates": DUPLICATES}


@pytest.mark.parametrize("kernel", CHECKS)
def test_kernel_matches_reference_under_interpreter(kernel):
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = textwrap.dedent(CHECKS[kernel]).format(device="cpu", block=16)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", CHECKS)
@pytest.mark.parametrize("block", [16, 64])
def test_kernel_matches_reference_on_cuda(kernel, block):
    exec(textwrap.dedent(CHECKS[kernel]).format(device="cuda", block=block), {})


def _divprune_step_scores(placed: torch.Tensor, picks: list[int]) -> list[torch.Tensor]:
    """The reference's candidate distances at each of its greedy steps (one image's placed tokens [L, D]): the
    nearest-other distance first, then the distance to the nearest pick, picks excluded."""
    unit = torch.nn.functional.normalize(placed.float(), dim=-1)
    distance = 1 - unit @ unit.T
    steps = [distance.kthvalue(2, dim=0).values]
    closest = torch.full_like(steps[0], float("inf"))
    taken = torch.zeros_like(steps[0], dtype=torch.bool)
    for pick in picks[:-1]:
        closest = torch.minimum(closest, distance[pick])
        taken[pick] = True
        steps.append(closest.masked_fill(taken, float("-inf")))
    return steps


def _coverage_step_scores(coverage: torch.Tensor, picks: list[int], weight=None) -> list[torch.Tensor]:
    """The reference's gains at each of its greedy steps (one crop's coverage [R, N], SCOPE's `weight` [N] or
    None), picks excluded."""
    best = coverage.new_zeros(coverage.shape[0], 1)
    taken = torch.zeros(coverage.shape[1], dtype=torch.bool, device=coverage.device)
    steps = []
    for pick in picks:
        gain = (coverage - best).clamp(min=0).sum(0) * (1 if weight is None else weight)
        steps.append(gain.masked_fill(taken, float("-inf")))
        taken[pick] = True
        best = torch.maximum(best, coverage[:, pick : pick + 1])
    return steps


def check_kernels_at_model_shapes(device: str, scale: int = 1) -> None:
    """LLaVA-NeXT's 5 x 576 tokens (DivPrune: the 2,928 placed ones) and MMTok's N = 2,916, as the benchmarks run
    them (`scale` divides the token counts); MMTok's and SCOPE's (weighted) coverage twice (the second call repeats the
    first bit for bit), MMTok's op equal to the unweighted one. The
    greedy ops' picks against their references under the near-tie policy (tests/near_ties.py): equal step by step,
    parting only where the reference's own candidates are within rounding, after enough equal steps to have
    checked something; VisPruner's kept tokens equal unless a similarity cut is within rounding."""
    from near_ties import greedy_steps_agreeing, same_kept, vispruner_margins

    g = torch.Generator(device=device).manual_seed(0)
    length, k = 2928 // scale, 732 // scale
    placed = torch.randn(1, length, 4096 // scale, device=device, generator=g)
    valid = torch.ones(1, length, dtype=torch.bool, device=device)
    counts = torch.tensor([k], device=device)
    want = max_min_diversity_reference(placed, valid, counts, k)[0].tolist()
    got = max_min_diversity(placed, valid, counts, k)[0].tolist()
    scores = _divprune_step_scores(placed[0], want)
    greedy_steps_agreeing(got, want, scores, 1e-5, min_steps=k // 4)  # fp32 cosines of 4,096-wide tokens
    for crops, n, k in ((5, 576 // scale, 144 // scale), (1, 2916 // scale, 583 // scale)):
        matrix = torch.rand(crops, n + 12, n, device=device, generator=g) ** 3 / n
        excluded = torch.zeros(crops, n, dtype=torch.bool, device=device)
        counts = torch.full((crops,), k, device=device)
        for weight in (None, torch.rand(crops, n, device=device, generator=g)):
            want = greedy_weighted_coverage_reference(matrix, weight, excluded, counts, k)
            got = greedy_weighted_coverage(matrix, weight, excluded, counts, k)
            assert torch.equal(greedy_weighted_coverage(matrix, weight, excluded, counts, k), got)
            if weight is None:
                assert torch.equal(greedy_max_coverage(matrix, excluded, counts, k), got)
            for crop in range(crops):
                scores = _coverage_step_scores(
                    matrix[crop], want[crop].tolist(), None if weight is None else weight[crop]
                )
                tolerance = 1e-6 * float(scores[0].max())  # fp32 sums of n + 12 gains
                greedy_steps_agreeing(got[crop].tolist(), want[crop].tolist(), scores, tolerance, min_steps=k // 4)
    tokens, width = 576 // scale, 32 // scale
    features = torch.randn(5, tokens, 1024 // scale, device=device, generator=g)
    residual = torch.stack([torch.randperm(tokens, device=device, generator=g) for _ in range(5)])
    lengths, keep = torch.full((5,), tokens - width, device=device), torch.full((5,), width, device=device)
    want = duplicate_removal_reference(features, residual, lengths, keep, width)
    got = duplicate_removal(features, residual, lengths, keep, width)
    for crop in range(5):
        order = residual[crop, : tokens - width]  # the residual in attention order: scores falling along it
        falling = torch.linspace(2.0, 1.0, len(order), device=device)
        margin = vispruner_margins(falling, features[crop, order], width, 0.0)["similarity"]
        same_kept(got[crop].tolist(), want[crop].tolist(), margin, 1e-5)


def test_the_model_shape_check_runs_on_cpu_at_a_tenth():
    """The CUDA check's comparisons, run here on the references (the CPU implementation of each op) at a tenth of
    the shapes: the check itself executes (the helpers, shapes and tolerances) where no GPU is lent."""
    check_kernels_at_model_shapes("cpu", scale=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_at_model_shapes_on_cuda():
    check_kernels_at_model_shapes("cuda")


OPS = {
    "max_min_diversity": (max_min_diversity, lambda: (torch.randn(2, 7, 3), torch.ones(2, 7, dtype=torch.bool),
                                                      torch.tensor([3, 7]), 7)),
    "greedy_max_coverage": (greedy_max_coverage, lambda: (torch.rand(2, 5, 6), torch.zeros(2, 6, dtype=torch.bool),
                                                          torch.tensor([2, 4]), 4)),
    "greedy_weighted_coverage": (greedy_weighted_coverage, lambda: (torch.rand(2, 5, 6), torch.rand(2, 6),
                                                                    torch.zeros(2, 6, dtype=torch.bool),
                                                                    torch.tensor([2, 4]), 4)),
    "duplicate_removal": (duplicate_removal, lambda: (torch.randn(2, 9, 3), torch.arange(9).expand(2, 9),
                                                      torch.tensor([9, 6]), torch.tensor([4, 2]), 4)),
}  # fmt: skip


@pytest.mark.parametrize("name", OPS)
def test_custom_op_is_registered_counts_once_and_has_meta_shapes(name):
    op, make = OPS[name]
    args = make()
    assert getattr(torch.ops.vtoken, name).default is not None
    with count_launches() as launches:
        out = op(*args)
    assert launches.kernels == 1 and launches.syncs == 0, launches.describe()
    assert out.dtype == torch.long and out.shape == (2, args[-1])
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert meta.device.type == "meta" and meta.shape == out.shape
    torch.library.opcheck(op, args)


AHEAD = {  # kernel -> (its module, pointer types, constexprs, num_warps as the launcher sets them)
    "_gram_kernel": ("gram", {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"BLOCK": 32, "BLOCK_D": 8}, 4),
    "_second_nearest_kernel": ("diversity", {"gram_ptr": "*fp32", "valid_ptr": "*i8", "out_ptr": "*fp32"},
                               {"BLOCK_R": 16, "BLOCK_C": 256}, 4),
    "_greedy_kernel": ("diversity", {"gram_ptr": "*fp32", "valid_ptr": "*i8", "second_ptr": "*fp32",
                                     "counts_ptr": "*i32", "picks_ptr": "*i64", "closest_ptr": "*fp32"},
                       {"BLOCK_L": 2048}, 8),
    "_coverage_step_kernel": ("coverage", {"cov_ptr": "*fp32", "weight_ptr": "*fp32", "best_ptr": "*fp32",
                                           "blocked_ptr": "*i8", "counts_ptr": "*i32", "picks_ptr": "*i64",
                                           "partial_ptr": "*fp32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
                                           "col_tickets_ptr": "*i32", "tickets_ptr": "*i32"},
                              {"WEIGHTED": True, "SPLIT": True, "BLOCK_N": 64, "BLOCK_R": 64}, 4),
    "_dedup_kernel": ("duplicates", {"gram_ptr": "*fp32", "residual_ptr": "*i64", "lengths_ptr": "*i32",
                                     "keep_ptr": "*i32", "out_ptr": "*i64", "lists_ptr": "*i64", "sim_ptr": "*fp32"},
                      {"ROUND": 8, "BLOCK": 64}, 4),
}  # fmt: skip
# the LLM drops' attention read (vtoken::visual_attention and its rotary sibling share these kernels), bf16 at
# head_dim 128 and 256 (Gemma 3), the tiles its launcher picks: the rows as given, and the queries and keys before
# rotary
VISUAL = {"q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "rows_ptr": "*i64",
          "valid_ptr": "*i8", "visual_ptr": "*i64", "max_ptr": "*fp32", "sum_ptr": "*fp32", "out_ptr": "*fp32",
          "scale": "fp32"}  # fmt: skip
for _rotary in (False, True):
    for _dim in (128, 256):
        _flags = {"ROTARY": _rotary, "ROTATE_KEYS": _rotary, "BLOCK_D": _dim}
        _variant = f"{'rotary' if _rotary else 'rotated'}-{_dim}"
        AHEAD[f"_normalisers_kernel[{_variant}]"] = ("visual_attention", VISUAL,
                                                     {**_flags, "BLOCK_S": 64 if _dim <= 128 else 32}, 8)  # fmt: skip
        AHEAD[f"_visual_columns_kernel[{_variant}]"] = ("visual_attention", VISUAL, {**_flags, "BLOCK_V": 16}, 4)


@pytest.mark.parametrize("name", AHEAD)
def test_kernel_compiles_for_h100_without_a_gpu_and_does_not_spill(name, tmp_path):
    """The interpreter does not check what the compiler rejects: compile ahead of time for sm_90 (ptxas ships with
    triton), at the block sizes the launchers use, and read ptxas's report: no register spills."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, pointers, constexprs, warps = AHEAD[name]
    kernel = getattr(importlib.import_module(f"vtoken.kernels.{module}"), name.split("[")[0])  # "[variant]": flags
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32") for arg in kernel.arg_names}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if ptxas.exists():
        ptx = tmp_path / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "k.cubin")],
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert report.returncode == 0, report.stderr[-2000:]
        assert "0 bytes spill stores, 0 bytes spill loads" in report.stderr, report.stderr[-2000:]
