"""Greedy (weighted) max coverage as custom ops: `vtoken::greedy_max_coverage` (MMTok) and
`vtoken::greedy_weighted_coverage` (SCOPE), one step kernel for both.

For every crop b, a coverage matrix C_b [R, N] (entries >= 0), optional column weights w_b [N] (>= 0) and k_b
steps: gain_j = w_j * sum over rows of max(C[row, j] - best[row], 0) over the columns not picked and not excluded
(-inf there); the first argmax is picked and best <- max(best, C[:, pick]). Without weights (w = 1) this is MMTok's
greedy, with them SCOPE's saliency-weighted one. The ops return each crop's picks in pick order, padded with N
past k_b.

CPU (and any device without triton): `greedy_weighted_coverage_reference`, the PyTorch reference (k batched steps).
CUDA: `greedy_weighted_coverage_triton`, one launch per step of one kernel over a 3-D grid of programs (crop,
column block, row split). A program sums its column block's gains over its share of the rows; where the rows are
split, the last program of a column block to finish (an atomic ticket) adds the splits' partial sums in a fixed
order (a run repeats bit for bit), weights them and writes the block's best; the last column block of a crop (a
second ticket) picks the crop's best column and updates its `best` row. Rows are split only as far as it takes to
give the GPU about `TARGET_PROGRAMS` programs per step (at N = 2,916 one crop is 46 column blocks: 12 row splits
make 552 programs on a 132-SM GPU, where 46 left most SMs idle), and never below `MIN_SPLIT_ROWS` rows a program.

Why one launch per step and no CUDA graph: the steps are sequential across programs (every program of step s + 1
reads the `best` row that step s's last program wrote), so a single persistent launch would need a grid-wide
barrier, which deadlocks under TRITON_INTERPRET=1 (programs run one after another) and whenever the grid is not all
resident, and so could never be tested here. A captured graph (the previous design) cost a capture per new shape
inside a request, a process-wide cache and "global" capture mode, which another thread's CUDA work breaks. Per-step
launches cost host time only: the launches are queued without waiting (no sync), so the host runs ahead of the GPU
as long as a step's GPU time (R x N x 4 bytes read: ~34 MB at N = 2,916, ~11 us at H100 bandwidth) exceeds a
launch's host time (~5-10 us); at small N (5 crops x 576) the host bounds it at ~k launches. Inside a caller's own
graph capture the launches are recorded into it. A launch counter sees each op as one launch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

BLOCK_N = 64  # columns per program
BLOCK_R = 64  # rows summed per inner step
MIN_SPLIT_ROWS = 256  # a program sums at least this many rows (fewer: the partial sums cost more than they share)
TARGET_PROGRAMS = 528  # programs per step worth filling a GPU with (4 per SM of a 132-SM H100 / H200)


def greedy_weighted_coverage_reference(
    coverage: torch.Tensor,
    weight: torch.Tensor | None,
    excluded: torch.Tensor,
    counts: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """coverage [B, R, N] (>= 0), weight [B, N] (>= 0) or None (all 1), excluded [B, N] bool (never picked while
    others remain), counts [B] -> [B, width] int64 picks in pick order, padded with N past counts[b]: k = width
    batched steps over all crops at once."""
    batch, rows, n = coverage.shape
    coverage = coverage.float()
    weight = None if weight is None else weight.float()
    best = coverage.new_zeros(batch, rows, 1)
    blocked = excluded.clone()
    picks = torch.empty(batch, width, dtype=torch.long, device=coverage.device)
    arange = torch.arange(batch, device=coverage.device)
    for step in range(width):
        gain = (coverage - best).clamp_(min=0).sum(1)  # [B, N]
        if weight is not None:
            gain = gain * weight
        pick = gain.masked_fill_(blocked, float("-inf")).argmax(-1)  # the first maximum
        picks[:, step] = pick
        blocked[arange, pick] = True
        best = torch.maximum(best, coverage[arange, :, pick][..., None])
    steps = torch.arange(width, device=coverage.device)
    return torch.where(steps < counts.to(coverage.device)[:, None], picks, n)


def greedy_max_coverage_reference(
    coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """`greedy_weighted_coverage_reference` without weights (MMTok's greedy)."""
    return greedy_weighted_coverage_reference(coverage, None, excluded, counts, width)


if triton is not None:

    @triton.jit
    def _coverage_step_kernel(
        cov_ptr, weight_ptr, best_ptr, blocked_ptr, counts_ptr, picks_ptr, partial_ptr, part_val_ptr, part_idx_ptr,
        col_tickets_ptr, tickets_ptr, step, rows, n, split_rows, splits, stride_cb, stride_cr, stride_wb, stride_bb,
        stride_kb, stride_pb, WEIGHTED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # 64-bit offsets into the crops' matrices
        b, block, part = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
        blocks = tl.num_programs(1)
        if step < tl.load(counts_ptr + b):
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = cols < n
            cov = cov_ptr + b * stride_cb
            gain = tl.zeros([BLOCK_N], dtype=tl.float32)
            first_row = part * split_rows
            for start in range(0, split_rows, BLOCK_R):
                r = first_row + start + tl.arange(0, BLOCK_R)
                c = tl.load(cov + r[:, None] * stride_cr + cols[None, :], mask=(r[:, None] < rows) & inside[None, :],
                            other=0.0)  # fmt: skip
                best = tl.load(best_ptr + b * stride_bb + r, mask=r < rows, other=0.0)
                gain += tl.sum(tl.maximum(c - best[:, None], 0.0), axis=0)
            last_part = step >= 0  # a scalar True: this program reduces its column block
            if SPLIT:  # rows split over programs: the block's last program adds the partial sums, in order
                slot = partial_ptr + (b * splits) * n
                tl.store(slot + part * n + cols, gain, mask=inside)
                tl.debug_barrier()  # every thread's stores before the ticket
                ticket = tl.atomic_add(col_tickets_ptr + b * blocks + block, 1, sem="acq_rel")
                last_part = ticket == splits - 1
                if last_part:
                    gain = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for s in range(0, splits):
                        gain += tl.load(slot + s * n + cols, mask=inside, other=0.0, volatile=True)
                    tl.store(col_tickets_ptr + b * blocks + block, 0)  # ready for the next step
            if last_part:
                if WEIGHTED:
                    gain = gain * tl.load(weight_ptr + b * stride_wb + cols, mask=inside, other=0.0)
                taken = tl.load(blocked_ptr + b * stride_kb + cols, mask=inside, other=1) != 0
                gain = tl.where(taken | ~inside, float("-inf"), gain)
                tl.store(part_val_ptr + b * blocks + block, tl.max(gain, axis=0))
                tl.store(part_idx_ptr + b * blocks + block,
                         (block * BLOCK_N + tl.argmax(gain, axis=0, tie_break_left=True)).to(tl.int32))  # fmt: skip
                tl.debug_barrier()  # every thread's stores before the ticket
                ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
                if ticket == blocks - 1:  # the crop's last column block: pick, mark, cover
                    high = float("-inf")
                    pick = 0
                    for start in range(0, blocks, BLOCK_N):
                        i = start + tl.arange(0, BLOCK_N)
                        v = tl.load(part_val_ptr + b * blocks + i, mask=i < blocks, other=float("-inf"), volatile=True)
                        at = tl.load(part_idx_ptr + b * blocks + i, mask=i < blocks, other=0, volatile=True)
                        top = tl.max(v, axis=0)
                        first = tl.min(tl.where(v == top, at, n), axis=0)  # equal gains: the lowest column
                        pick = tl.where(top > high, first, pick)
                        high = tl.maximum(high, top)
                    tl.store(picks_ptr + b * stride_pb + step, pick.to(tl.int64))
                    tl.store(blocked_ptr + b * stride_kb + pick, 1)
                    for start in range(0, rows, BLOCK_R):
                        r = start + tl.arange(0, BLOCK_R)
                        c = tl.load(cov + r * stride_cr + pick, mask=r < rows, other=0.0)
                        best = tl.load(best_ptr + b * stride_bb + r, mask=r < rows, other=0.0)
                        tl.store(best_ptr + b * stride_bb + r, tl.maximum(best, c), mask=r < rows)
                    tl.store(tickets_ptr + b, 0)  # ready for the next step


def row_splits(batch: int, rows: int, n: int) -> int:
    """How many programs share a crop's rows (host arithmetic on shapes): enough to give the step about
    `TARGET_PROGRAMS` programs, each summing at least `MIN_SPLIT_ROWS` rows."""
    blocks = -(-n // BLOCK_N)
    wanted = -(-TARGET_PROGRAMS // max(batch * blocks, 1))
    return max(1, min(wanted, -(-rows // MIN_SPLIT_ROWS)))


def greedy_weighted_coverage_triton(
    coverage: torch.Tensor,
    weight: torch.Tensor | None,
    excluded: torch.Tensor,
    counts: torch.Tensor,
    width: int,
    splits: int | None = None,
) -> torch.Tensor:
    """`greedy_weighted_coverage_reference`'s signature and picks, one kernel launch per step (CUDA, or CPU under
    TRITON_INTERPRET=1). `splits`: programs per crop and column block sharing the rows (None: `row_splits`)."""
    if triton is None:
        raise RuntimeError("greedy_weighted_coverage_triton needs triton (pip install 'vtoken[kernels]')")
    batch, rows, n = coverage.shape
    device = coverage.device
    picks = torch.full((batch, width), n, dtype=torch.long, device=device)
    if batch == 0 or n == 0 or width == 0:
        return picks
    coverage = coverage.float().contiguous()
    weighted = weight is not None
    weight = weight.float().contiguous() if weighted else coverage  # (unread without weights)
    blocked = excluded.to(torch.int8).contiguous()
    best = torch.zeros(batch, max(rows, 1), device=device, dtype=torch.float32)
    blocks = triton.cdiv(n, BLOCK_N)
    splits = row_splits(batch, rows, n) if splits is None else max(1, min(splits, max(rows, 1)))
    split_rows = triton.cdiv(triton.cdiv(max(rows, 1), splits), BLOCK_R) * BLOCK_R  # whole inner steps a program
    splits = triton.cdiv(max(rows, 1), split_rows)
    partial = torch.empty(batch, splits if splits > 1 else 0, n, device=device, dtype=torch.float32)
    part_val = torch.empty(batch, blocks, device=device, dtype=torch.float32)
    part_idx = torch.empty(batch, blocks, device=device, dtype=torch.int32)
    tickets = torch.zeros(batch * (blocks + 1), device=device, dtype=torch.int32)  # per column block, then per crop
    col_tickets, crop_tickets = tickets[: batch * blocks], tickets[batch * blocks :]
    counts = counts.to(device=device, dtype=torch.int32).contiguous()
    for step in range(width):
        _coverage_step_kernel[(batch, blocks, splits)](
            coverage, weight, best, blocked, counts, picks, partial, part_val, part_idx, col_tickets, crop_tickets,
            step, rows, n, split_rows, splits, coverage.stride(0), coverage.stride(1), weight.stride(0),
            best.stride(0), blocked.stride(0), picks.stride(0), WEIGHTED=weighted, SPLIT=splits > 1,
            BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        )  # fmt: skip
    return picks


def greedy_max_coverage_triton(
    coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int, splits: int | None = None
) -> torch.Tensor:
    """`greedy_weighted_coverage_triton` without weights (MMTok's greedy)."""
    return greedy_weighted_coverage_triton(coverage, None, excluded, counts, width, splits)


@torch.library.custom_op("vtoken::greedy_weighted_coverage", mutates_args=())
def greedy_weighted_coverage(
    coverage: torch.Tensor, weight: torch.Tensor | None, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """SCOPE's greedy picks for every crop of a batch (see the module): coverage [B, R, N] >= 0, weight [B, N] >= 0
    (None: MMTok's unweighted gains), excluded [B, N] bool, counts [B] int64 -> [B, width] int64 in pick order,
    padded with N past counts[b]."""
    return greedy_weighted_coverage_reference(coverage, weight, excluded, counts, width)


@greedy_weighted_coverage.register_fake
def _(
    coverage: torch.Tensor, weight: torch.Tensor | None, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    return coverage.new_empty(coverage.shape[0], width, dtype=torch.long)


@torch.library.custom_op("vtoken::greedy_max_coverage", mutates_args=())
def greedy_max_coverage(
    coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """MMTok's greedy picks for every crop of a batch (see the module): coverage [B, R, N] >= 0, excluded [B, N]
    bool, counts [B] int64 -> [B, width] int64 in pick order, padded with N past counts[b]."""
    return greedy_max_coverage_reference(coverage, excluded, counts, width)


@greedy_max_coverage.register_fake
def _(coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    return coverage.new_empty(coverage.shape[0], width, dtype=torch.long)


if triton is not None:

    @greedy_weighted_coverage.register_kernel("cuda")
    def _(
        coverage: torch.Tensor, weight: torch.Tensor | None, excluded: torch.Tensor, counts: torch.Tensor, width: int
    ) -> torch.Tensor:
        return greedy_weighted_coverage_triton(coverage, weight, excluded, counts, width)

    @greedy_max_coverage.register_kernel("cuda")
    def _(coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
        return greedy_weighted_coverage_triton(coverage, None, excluded, counts, width)
