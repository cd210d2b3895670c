"""MMTok's greedy max coverage as one custom op, `vtoken::greedy_max_coverage`.

For every crop b, a coverage matrix C_b [R, N] (entries >= 0) and k_b steps: gain_j = sum over rows of
max(C[row, j] - best[row], 0) over the columns not picked and not excluded; the first argmax is picked and
best <- max(best, C[:, pick]). The op returns each crop's picks in pick order, padded with N past k_b.

CPU (and any device without triton): `greedy_max_coverage_reference`, the PyTorch reference (k batched steps).
CUDA: `greedy_max_coverage_triton`, one launch per step of one kernel over (crop, column block) programs: each
program sums its columns' gains over all rows, and the last program of a crop to finish (an atomic ticket) picks
the crop's best column and updates its `best` row; at N = 2,916 the step reads ~34 MB of coverage, so the rows of
a crop are spread over many programs rather than held by one. The k launches are captured once per shape in a CUDA
graph and replayed (`_graphed`), so a call costs a few host operations whatever k is; inside a caller's own graph
capture they are recorded into it. A launch counter sees the op as one launch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

BLOCK_N = 64  # columns per program
BLOCK_R = 64  # rows summed per inner step (a crop's rows padded to a multiple of this give the same sums)
GRAPHS = 4  # captured step sequences kept per process (each holds its shape's buffers)


def greedy_max_coverage_reference(
    coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """coverage [B, R, N] (>= 0), excluded [B, N] bool (never picked while others remain), counts [B] -> [B, width]
    int64 picks in pick order, padded with N past counts[b]: k = width batched steps over all crops at once."""
    batch, rows, n = coverage.shape
    best = coverage.new_zeros(batch, rows, 1)
    blocked = excluded.clone()
    picks = torch.empty(batch, width, dtype=torch.long, device=coverage.device)
    arange = torch.arange(batch, device=coverage.device)
    for step in range(width):
        gain = (coverage - best).clamp_(min=0).sum(1)  # [B, N]
        pick = gain.masked_fill_(blocked, float("-inf")).argmax(-1)  # the first maximum
        picks[:, step] = pick
        blocked[arange, pick] = True
        best = torch.maximum(best, coverage[arange, :, pick][..., None])
    steps = torch.arange(width, device=coverage.device)
    return torch.where(steps < counts.to(coverage.device)[:, None], picks, n)


if triton is not None:

    @triton.jit
    def _coverage_step_kernel(
        cov_ptr, best_ptr, blocked_ptr, counts_ptr, picks_ptr, part_val_ptr, part_idx_ptr, tickets_ptr, step,
        rows, n, stride_cb, stride_cr, stride_bb, stride_kb, stride_pb, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        b, block = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit offsets into the crops' matrices
        blocks = tl.num_programs(1)
        if step < tl.load(counts_ptr + b):
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = cols < n
            gain = tl.zeros([BLOCK_N], dtype=tl.float32)
            cov = cov_ptr + b * stride_cb
            for start in range(0, rows, BLOCK_R):
                r = start + tl.arange(0, BLOCK_R)
                c = tl.load(cov + r[:, None] * stride_cr + cols[None, :], mask=(r[:, None] < rows) & inside[None, :],
                            other=0.0)  # fmt: skip
                best = tl.load(best_ptr + b * stride_bb + r, mask=r < rows, other=0.0)
                gain += tl.sum(tl.maximum(c - best[:, None], 0.0), axis=0)
            taken = tl.load(blocked_ptr + b * stride_kb + cols, mask=inside, other=1) != 0
            gain = tl.where(taken | ~inside, float("-inf"), gain)
            tl.store(part_val_ptr + b * blocks + block, tl.max(gain, axis=0))
            tl.store(part_idx_ptr + b * blocks + block, block * BLOCK_N + tl.argmax(gain, axis=0, tie_break_left=True))
            tl.debug_barrier()  # every thread's stores before the ticket
            ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
            if ticket == blocks - 1:  # the crop's last program: pick, mark, cover
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


def greedy_max_coverage_triton(
    coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """`greedy_max_coverage_reference`'s signature and picks, one kernel launch per step (CUDA, or CPU under
    TRITON_INTERPRET=1); `greedy_max_coverage` replays the launches from a CUDA graph."""
    if triton is None:
        raise RuntimeError("greedy_max_coverage_triton needs triton (pip install 'vtoken[kernels]')")
    batch, rows, n = coverage.shape
    device = coverage.device
    picks = torch.full((batch, width), n, dtype=torch.long, device=device)
    if batch == 0 or n == 0 or width == 0:
        return picks
    coverage = coverage.float().contiguous()
    blocked = excluded.to(torch.int8).contiguous()
    best = torch.zeros(batch, rows, device=device, dtype=torch.float32)
    blocks = triton.cdiv(n, BLOCK_N)
    part_val = torch.empty(batch, blocks, device=device, dtype=torch.float32)
    part_idx = torch.empty(batch, blocks, device=device, dtype=torch.int32)
    tickets = torch.zeros(batch, device=device, dtype=torch.int32)
    counts = counts.to(device=device, dtype=torch.int32).contiguous()
    for step in range(width):
        _coverage_step_kernel[(batch, blocks)](
            coverage, best, blocked, counts, picks, part_val, part_idx, tickets, step, rows, n, coverage.stride(0),
            coverage.stride(1), best.stride(0), blocked.stride(0), picks.stride(0), BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        )  # fmt: skip
    return picks


class _Graphed:
    """One captured step sequence: its static inputs, its output, the graph. Its tensors are never inference
    tensors: a graph captured inside `torch.inference_mode` is filled and replayed outside it too."""

    @torch.inference_mode(False)
    def __init__(self, batch: int, rows: int, n: int, width: int, device: torch.device) -> None:
        self.coverage = torch.zeros(batch, rows, n, device=device, dtype=torch.float32)
        self.excluded = torch.zeros(batch, n, device=device, dtype=torch.bool)
        self.counts = torch.zeros(batch, device=device, dtype=torch.int64)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            greedy_max_coverage_triton(self.coverage, self.excluded, self.counts, width)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.picks = greedy_max_coverage_triton(self.coverage, self.excluded, self.counts, width)


_graphs: OrderedDict[tuple, _Graphed] = OrderedDict()
_graphs_lock = threading.Lock()


def _graphed(coverage: torch.Tensor, excluded: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The CUDA implementation: replay the step launches from a graph captured once per (crops, rows rounded up to
    BLOCK_R, columns, steps, stream); the padded rows are zeros, which add exactly nothing to any gain."""
    if torch.cuda.is_current_stream_capturing():  # inside the caller's graph: record the launches into it
        return greedy_max_coverage_triton(coverage, excluded, counts, width)
    batch, rows, n = coverage.shape
    padded = -(-rows // BLOCK_R) * BLOCK_R
    stream = torch.cuda.current_stream(coverage.device)
    key = (batch, padded, n, width, coverage.device, stream.cuda_stream)
    with _graphs_lock:  # one call at a time fills a graph's inputs and replays it
        entry = _graphs.pop(key, None)
        if entry is None:
            while len(_graphs) >= GRAPHS:
                _graphs.popitem(last=False)
            entry = _Graphed(batch, padded, n, width, coverage.device)
        _graphs[key] = entry
        entry.coverage[:, :rows].copy_(coverage)
        entry.coverage[:, rows:].zero_()
        entry.excluded.copy_(excluded)
        entry.counts.copy_(counts)
        entry.graph.replay()
        return entry.picks.clone()


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
    greedy_max_coverage.register_kernel("cuda")(_graphed)
