"""Small integer tables on the device from host integers, without a host sync.

`torch.tensor(list, device=cuda)` copies from pageable host memory and waits for the device's queue. `on_device`
instead copies once from pinned host memory without waiting; the other helpers take views of one `arange` made on
the device (an allocation and one kernel) and concatenate them (one kernel), the values travelling as kernel
arguments: a table of any length costs a fixed few launches.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch


def on_device(values: Sequence[int] | array.array, device: torch.device | str) -> torch.Tensor:
    """[len(values)] int64 on `device` from host integers (a list, or an int64 `array.array` used as it is) without a
    host sync (on a CUDA GPU: one non-blocking copy from pinned host memory; on the CPU: the host buffer itself;
    elsewhere, e.g. `meta`: a plain copy)."""
    device = torch.device(device)
    if not len(values):
        return torch.zeros(0, dtype=torch.long, device=device)
    buffer = values if isinstance(values, array.array) and values.typecode == "q" else array.array("q", values)
    host = torch.frombuffer(buffer, dtype=torch.int64)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def repeated(values: list[int], times: list[int], device: torch.device | str) -> torch.Tensor:
    """[sum(times)] LongTensor: each of the non-negative `values` repeated `times[i]` times, on `device`."""
    if not values:
        return torch.zeros(0, dtype=torch.long, device=device)
    source = torch.arange(max(values) + 1, device=device)
    return torch.cat([source[v : v + 1].expand(n) for v, n in zip(values, times, strict=True)])


def segment_aranges(lengths: list[int], device: torch.device | str, width: int | None = None) -> torch.Tensor:
    """[sum(lengths)] LongTensor: 0..lengths[i]-1 for each segment, concatenated, on `device`."""
    if not lengths:
        return torch.zeros(0, dtype=torch.long, device=device)
    source = torch.arange(max(max(lengths), width or 0, 1), device=device)
    return torch.cat([source[:n] for n in lengths])


def padded_rows(counts: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """[sum(counts)] flat indices into a [len(counts), width] tensor of the first counts[r] entries of every row r
    (to take the real entries of rows padded past their counts)."""
    if not counts:
        return torch.zeros(0, dtype=torch.long, device=device)
    source = torch.arange(len(counts) * max(width, 1), device=device).view(len(counts), max(width, 1))
    return torch.cat([source[r, :n] for r, n in enumerate(counts)])


def stack_padded(items: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """[R, width, ...] the items [n_i, ...] stacked, each zero-padded at the end to `width` (default: the longest),
    in three kernels whatever R."""
    lengths = [len(item) for item in items]
    width = max(lengths) if width is None else width
    first = items[0]
    out = first.new_zeros(len(items) * width, *first.shape[1:])
    out[padded_rows(lengths, width, first.device)] = torch.cat(items)
    return out.view(len(items), width, *first.shape[1:])
