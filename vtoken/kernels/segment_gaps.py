"""PruneVid's relabelling of the frames left between kept segments: a left-to-right scan over a video's frames.

After PruneVid's frame clustering, each label keeps its longest runs of frames (when at least 2 long); every other
frame is free. The maximal runs of free frames (gaps) are then relabelled left to right: a gap takes the label of
its left or right neighbour, whichever block is longer (ties, and a gap with neither, to the left; a gap with no
neighbour at all to label 0). The right neighbour's block is its kept run; the left neighbour's is measured in the
sequence *as already relabelled* (a gap relabelled to the same label just before it counts), so each gap's choice
depends on the previous one: a sequential scan, on CUDA one Triton program per video looping over its F frames
(no host sync); the PyTorch reference runs elsewhere. `fill_gaps` is the custom op `vtoken::fill_gaps` (one
launch).
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def fill_gaps_reference(
    labels: torch.Tensor, kept: torch.Tensor, right_length: torch.Tensor, right_label: torch.Tensor
) -> torch.Tensor:
    """labels: [B, F] int64, every frame's label (read where `kept`); kept: [B, F] bool, frames of kept runs;
    right_length / right_label: [B, F] int64, for a free frame the length and label of the kept run right after its
    gap (length 0: none). Returns [B, F] int64: kept frames their label, every gap the label it takes."""
    batch, frames = labels.shape
    out = []
    tables = (labels, kept, right_length, right_label)
    rows = zip(*(t.cpu().tolist() for t in tables), strict=True)
    for label, keep, length, after in rows:
        refined, current, run, gap = [], -1, 0, 0
        for f in range(frames):
            if keep[f]:
                value = label[f]
            else:
                if f == 0 or keep[f - 1]:  # a gap starts: left block = the run ending at f - 1, as relabelled
                    if f > 0 and run >= length[f]:
                        gap = current
                    elif length[f] > 0:
                        gap = after[f]
                    else:
                        gap = 0
                value = gap
            run = run + 1 if value == current else 1
            current = value
            refined.append(value)
        out.append(refined)
    return torch.tensor(out, dtype=torch.long).view(batch, frames).to(labels.device)


if triton is not None:

    @triton.jit
    def _fill_gaps_kernel(labels_ptr, kept_ptr, length_ptr, after_ptr, out_ptr, frames):
        # one program per video; the running state (current label, its run length, the open gap's label and whether
        # the previous frame was kept) is carried through the frames as scalars
        b = tl.program_id(0)
        base = b * frames
        current = tl.full([], -1, tl.int64)
        run = tl.full([], 0, tl.int64)
        gap = tl.full([], 0, tl.int64)
        previous = tl.full([], 1, tl.int32)  # "kept" before the first frame: frame 0 may start a gap
        for f in range(0, frames):
            keep = tl.load(kept_ptr + base + f).to(tl.int32)
            label = tl.load(labels_ptr + base + f)
            length = tl.load(length_ptr + base + f)
            after = tl.load(after_ptr + base + f)
            starts = (keep == 0) & (previous != 0)
            left = (f > 0) & (run >= length)
            chosen = tl.where(left, current, tl.where(length > 0, after, 0))
            gap = tl.where(starts, chosen, gap)
            value = tl.where(keep != 0, label, gap)
            run = tl.where(value == current, run + 1, 1)
            current = value
            previous = keep
            tl.store(out_ptr + base + f, value)


def fill_gaps_triton(
    labels: torch.Tensor, kept: torch.Tensor, right_length: torch.Tensor, right_label: torch.Tensor
) -> torch.Tensor:
    """Triton version of `fill_gaps_reference` (same signature and result)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, frames = labels.shape
    out = torch.empty(batch, frames, dtype=torch.long, device=labels.device)
    if batch and frames:
        _fill_gaps_kernel[(batch,)](labels.long().contiguous(), kept.to(torch.int8).contiguous(),
                                    right_length.long().contiguous(), right_label.long().contiguous(), out,
                                    frames)  # fmt: skip
    return out


@torch.library.custom_op("vtoken::fill_gaps", mutates_args=())
def fill_gaps(
    labels: torch.Tensor, kept: torch.Tensor, right_length: torch.Tensor, right_label: torch.Tensor
) -> torch.Tensor:
    """[B, F] the frames' labels with every gap relabelled (see `fill_gaps_reference`): the reference here, the
    Triton kernel for CUDA tensors."""
    return fill_gaps_reference(labels, kept, right_length, right_label)


@fill_gaps.register_fake
def _(labels: torch.Tensor, kept: torch.Tensor, right_length: torch.Tensor, right_label: torch.Tensor) -> torch.Tensor:
    return labels.new_empty(labels.shape, dtype=torch.long)


# the reference copies the tables to the host and scans there
register_cuda(fill_gaps, fill_gaps_triton, fill_gaps_reference, host_loop=True)
