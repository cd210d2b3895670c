"""HoliTom's global search for static windows: a dynamic programme over a video's frames.

Merging the frames s..e of a window into one removes gain[s, e] tokens (HoliTom: (e - s) times the positions that
stay similar across the whole window). The best split of frames 0..F-1 into consecutive windows maximises the
total:

    best[i] = max(best[i - 1], max over w = 2..min(i + 1, max_window) of best[i - w] + gain[i - w + 1, i])

with best[-1] = 0; a window ending at i replaces "frame i alone" only when it is strictly better, and among equal
windows the shortest wins (the official loop: w increasing, strict `>`). Backtracking from the last frame gives
the windows. The recursion is sequential in F, so on CUDA it is one Triton program per video (F steps on the
device, no host sync); the PyTorch reference runs elsewhere. `static_windows` is the custom op
`vtoken::static_windows` (one launch).
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def static_windows_reference(gain: torch.Tensor, max_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gain: [B, F, F] float (gain[b, s, e]: tokens removed by merging frames s..e; read for e > s only);
    max_window: the longest window. Returns (start [B, F] int64: the first frame of each frame's window, removed
    [B] float32: best[F - 1], the tokens the windows remove)."""
    batch, frames = gain.shape[:2]
    table = gain.float().cpu().tolist()
    starts, removed = [], []
    for rows in table:
        best, back = [], []
        for i in range(frames):
            value, start = (best[i - 1] if i else 0.0), i
            for width in range(2, min(i + 1, max_window) + 1):
                j = i - width
                candidate = (best[j] if j >= 0 else 0.0) + rows[j + 1][i]
                if candidate > value:
                    value, start = candidate, j + 1
            best.append(value)
            back.append(start)
        frame_start = [0] * frames
        i = frames - 1
        while i >= 0:
            for f in range(back[i], i + 1):
                frame_start[f] = back[i]
            i = back[i] - 1
        starts.append(frame_start)
        removed.append(best[-1])
    return (torch.tensor(starts, dtype=torch.long).view(batch, frames).to(gain.device),
            torch.tensor(removed, dtype=torch.float32).to(gain.device))  # fmt: skip


if triton is not None:

    @triton.jit
    def _windows_kernel(
        gain_ptr, best_ptr, back_ptr, start_ptr, removed_ptr,
        frames, max_window,
        stride_gb, stride_gs, stride_ge,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # one program per video: best[i] and its window start for i = 0..F-1 (candidate widths as one vector),
        # kept in scratch rows of global memory; then the backtrack from the last frame
        b = tl.program_id(0)
        widths = tl.arange(0, BLOCK)
        best_row = best_ptr + b * frames
        back_row = back_ptr + b * frames
        gain_row = gain_ptr + b * stride_gb
        previous = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # best[i - 1], 0 before the first frame
        for i in range(0, frames):
            fits = (widths >= 2) & (widths <= i + 1) & (widths <= max_window)
            j = i - widths
            before = tl.load(best_row + j, mask=fits & (j >= 0), other=0.0)
            window = tl.load(gain_row + (j + 1) * stride_gs + i * stride_ge, mask=fits, other=0.0)
            candidates = tl.where(fits, before + window, float("-inf"))
            top = tl.max(candidates, axis=0)
            width = tl.argmax(candidates, axis=0, tie_break_left=True)  # the shortest of equal windows
            better = top > previous
            previous = tl.where(better, top, previous)
            tl.store(best_row + i, previous)
            tl.store(back_row + i, tl.where(better, i - width + 1, i).to(tl.int32))
            tl.debug_barrier()  # this step's best is read by the next ones
        frame = frames - 1
        while frame >= 0:
            first = tl.load(back_row + frame)
            tl.store(start_ptr + b * frames + widths, first.to(tl.int64),
                     mask=(widths >= first) & (widths <= frame))  # fmt: skip
            frame = first - 1
        tl.store(removed_ptr + b, previous)


def static_windows_triton(gain: torch.Tensor, max_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `static_windows_reference` (same signature and result)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, frames = gain.shape[:2]
    gain = gain.float()
    best = torch.empty(batch, frames, device=gain.device, dtype=torch.float32)
    back = torch.empty(batch, frames, device=gain.device, dtype=torch.int32)
    start = torch.empty(batch, frames, device=gain.device, dtype=torch.long)
    removed = torch.empty(batch, device=gain.device, dtype=torch.float32)
    _windows_kernel[(batch,)](
        gain, best, back, start, removed,
        frames, max_window,
        gain.stride(0), gain.stride(1), gain.stride(2),
        BLOCK=max(16, triton.next_power_of_2(frames + 1)),
    )  # fmt: skip
    return start, removed


@torch.library.custom_op("vtoken::static_windows", mutates_args=())
def static_windows(gain: torch.Tensor, max_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start [B, F], removed [B]) of the best static windows (see `static_windows_reference`): the reference here,
    the Triton kernel for CUDA tensors."""
    return static_windows_reference(gain, max_window)


@static_windows.register_fake
def _(gain: torch.Tensor, max_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, frames = gain.shape[:2]
    return gain.new_empty(batch, frames, dtype=torch.long), gain.new_empty(batch, dtype=torch.float32)


# the reference copies the gains to the host and runs the dynamic programme there
register_cuda(static_windows, static_windows_triton, static_windows_reference, host_loop=True)
