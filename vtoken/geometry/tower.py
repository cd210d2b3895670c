"""A Qwen-VL vision tower run on some of its merge groups (the tower stage, PixelPrune): host tables, in numpy.

The processor orders an image's patch rows group by group (merge x merge patches per group, groups in raster
order over (h / merge) x (w / merge)), images one after another. Given the kept groups (ascending global group
indices over all images) and every image's (t, h, w) patches (t = 1), these build what the tower's forward
would build from the full grid, restricted to the kept groups: the pixel rows to gather, the 2-D rotary position
ids, the per-image `cu_seqlens`, Qwen3-VL's bilinear position-embedding taps, Qwen2.5-VL's window order and
`cu_window_seqlens` (windows from the full grid, empty ones dropped). The same arithmetic as transformers'
`vision_utils` (float32 where it computes in float32), so a tower keeping every group gives the stock result
bit for bit. Host-only (numpy): the kept set is on the host already (PixelPrune's one read); the tables reach
the device as non-blocking copies.
"""

from __future__ import annotations

import numpy as np


def group_layout(grids: list[tuple[int, int, int]], merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per global group: its image, its group row and its group column (each [G] int64)."""
    sizes = [t * (h // merge) * (w // merge) for t, h, w in grids]
    image = np.repeat(np.arange(len(grids)), sizes)
    starts = np.repeat(np.cumsum([0, *sizes[:-1]]), sizes).astype(np.int64)
    cols = np.repeat([w // merge for _, _, w in grids], sizes).astype(np.int64)
    rows_per_frame = np.repeat([(h // merge) * (w // merge) for _, h, w in grids], sizes).astype(np.int64)
    local = (np.arange(sum(sizes)) - starts) % np.maximum(rows_per_frame, 1)
    return image, local // np.maximum(cols, 1), local % np.maximum(cols, 1)


def kept_rows(kept: np.ndarray, merge: int) -> np.ndarray:
    """[K * merge^2] the pixel rows of the kept groups, group after group."""
    unit = merge * merge
    return (kept[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)


def rotary_positions(kept: np.ndarray, grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """[K * merge^2, 2] (h, w) patch positions of the kept rows (`get_vision_position_ids`' block order)."""
    _, group_row, group_col = group_layout(grids, merge)
    inner = np.arange(merge * merge)
    h = group_row[kept][:, None] * merge + inner[None, :] // merge
    w = group_col[kept][:, None] * merge + inner[None, :] % merge
    return np.stack([h.reshape(-1), w.reshape(-1)], axis=1).astype(np.int64)


def cu_seqlens(counts: list[int], merge: int) -> tuple[np.ndarray, int]:
    """([I + 1] int32 cumulative rows of every image's kept groups, the longest image's rows)."""
    rows = np.asarray(counts, dtype=np.int64) * merge * merge
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32), int(rows.max(initial=0))


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners=True, border padding) of positions `index` on axes of `size` into a `side`-long
    table, in float32 as `vision_utils._interpolation_axis_taps_weights` computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.int64)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0))


def interpolation(
    kept: np.ndarray, grids: list[tuple[int, int, int]], merge: int, side: int
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned position embedding of the kept rows: ([K * merge^2, 4] int64 indices into the flattened
    side x side table, [K * merge^2, 4] float32 bilinear weights), as `get_vision_interpolation_indices_and_weights`
    (bilinear, align_corners=True)."""
    image, _, _ = group_layout(grids, merge)
    positions = rotary_positions(kept, grids, merge)
    per_row = np.repeat(image[kept], merge * merge)
    heights = np.asarray([h for _, h, _ in grids], dtype=np.int64)[per_row]
    widths = np.asarray([w for _, _, w in grids], dtype=np.int64)[per_row]
    h_taps, h_weights = _axis_taps(positions[:, 0], heights, side)
    w_taps, w_weights = _axis_taps(positions[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices.astype(np.int64), weights.astype(np.float32)


def windows(
    kept: np.ndarray, grids: list[tuple[int, int, int]], merge: int, window: int, patch: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Qwen2.5-VL's window attention on the kept groups: ([K] the kept sequence's groups in window order (indices
    into the kept groups), [W + 1] int32 cumulative rows of the non-empty windows, the largest window's rows).
    Windows are those of the full grid (`window // merge // patch` groups a side, padded at the bottom and right),
    visited as `get_vision_window_index` visits them."""
    side = window // merge // patch
    order, window_of, first_window, first_group = [], [], 0, 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        pad_rows, pad_cols = side - rows % side, side - cols % side
        win_rows, win_cols = (rows + pad_rows) // side, (cols + pad_cols) // side
        index = np.full((t, rows + pad_rows, cols + pad_cols), -1, dtype=np.int64)
        index[:, :rows, :cols] = np.arange(t * rows * cols).reshape(t, rows, cols)
        ids = np.broadcast_to(
            np.arange(t * win_rows * win_cols).reshape(t, win_rows, 1, win_cols, 1),
            (t, win_rows, side, win_cols, side),
        )
        index = index.reshape(t, win_rows, side, win_cols, side).transpose(0, 1, 3, 2, 4).reshape(-1)
        ids = ids.transpose(0, 1, 3, 2, 4).reshape(-1)
        real = index >= 0
        order.append(index[real] + first_group)
        window_of.append(ids[real] + first_window)
        first_group += t * rows * cols
        first_window += t * win_rows * win_cols
    order_all = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    window_all = np.concatenate(window_of) if window_of else np.zeros(0, dtype=np.int64)
    rank = np.full(first_group, -1, dtype=np.int64)
    rank[kept] = np.arange(len(kept))
    chosen = rank[order_all] >= 0
    sequence = rank[order_all][chosen]
    per_window = np.bincount(window_all[chosen], minlength=first_window) * merge * merge
    per_window = per_window[per_window > 0]
    cumulative = np.concatenate([[0], np.cumsum(per_window)]).astype(np.int32)
    return sequence, cumulative, int(per_window.max(initial=0))
