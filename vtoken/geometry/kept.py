"""Where a selection's output rows come from and where they stand, for every crop at once (`Selection` in, tensors
out): the rows every crop keeps, flattened crop after crop, and the token each stands at on its crop's grid.

Shared by the transformers adapters and the vLLM plugin, which both gather a method's kept rows this way: one
gather for all crops, whatever their number and whether they keep equal numbers.
"""

from __future__ import annotations

import torch

from ..tokens import Selection
from .tables import padded_rows


def output_places(selection: Selection) -> torch.Tensor:
    """[C, k] the token each crop's output rows stand at (`Selection.offsets_of` of every crop at once): kept
    indices, a merge's anchors, else the rows in order."""
    if selection.kept is not None:
        return selection.kept
    if selection.anchors is not None:
        return selection.anchors
    rows = selection.features
    return torch.arange(rows.shape[1], device=rows.device).expand(rows.shape[0], -1)


def flat_kept(selection: Selection, features: torch.Tensor) -> torch.Tensor:
    """[sum of kept, D] every crop's output rows, crop after crop (`Selection.gather_flat`): the kept rows of
    `features` [C, N, D] (or a merge's own rows), in one gather of the real entries."""
    width = max(selection.num_kept, 1)
    rows = padded_rows(selection.counts_per_crop(), width, features.device)
    if selection.kept is None:
        return selection.features.flatten(0, 1)[rows]
    crops = rows // width
    index = crops * features.shape[1] + selection.kept.flatten()[rows].clamp(max=features.shape[1] - 1)
    return features.flatten(0, 1)[index]


def kept_rows(selection: Selection, features: torch.Tensor, signals: dict, project) -> torch.Tensor:
    """[sum of kept, D] every crop's output rows in the LLM's space, crop after crop: gathered from the
    "projected" signal when a method already projected every token (MMTok), else the kept rows of `features`
    projected now (only those: the projector acts on every token alone)."""
    projected = signals.get("projected")
    if projected is not None and selection.kept is not None:
        return flat_kept(selection, projected)
    rows = flat_kept(selection, features)  # the same launches whatever the counts
    if selection.counts is None:  # every crop keeps k: projected as one [C, k, D] batch (the same sums as ever)
        return project(rows.view(len(selection.counts_per_crop()), selection.num_kept, -1)).flatten(0, 1)
    return project(rows)


def item_groups(selection: Selection, crops: list[int]) -> tuple[list[torch.Tensor], list[list[int]]] | None:
    """Per item (an image or video of `crops[i]` consecutive crops), [k_i] the group of each of its output rows in
    `flat_kept`'s order, numbered within the item (a selection's group 2c / 2c + 1 of crop c becomes 2c' / 2c' + 1 of
    the item's crop c'; -1 stays), and the item's group sizes (host); None when the selection has no groups."""
    if selection.groups is None or selection.group_sizes is None:
        return None
    counts = selection.counts_per_crop()
    flat = selection.groups.flatten()[padded_rows(counts, max(selection.num_kept, 1), selection.groups.device)]
    firsts = [sum(crops[:i]) for i in range(len(crops))]
    kept = [sum(counts[f : f + n]) for f, n in zip(firsts, crops, strict=True)]
    groups = [torch.where(g >= 0, g - 2 * f, -1) for g, f in zip(flat.split(kept), firsts, strict=True)]
    sizes = [list(selection.group_sizes[2 * f : 2 * (f + n)]) for f, n in zip(firsts, crops, strict=True)]
    return groups, sizes
