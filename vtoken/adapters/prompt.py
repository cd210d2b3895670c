"""Shrinking the placeholder runs of a tokenized prompt after visual tokens were dropped.

The model checks that the number of image placeholders equals the number of visual features, so every dropped
token takes its placeholder with it, and the attention mask, labels and position ids follow. Rows that lose
different numbers of tokens are re-padded on the side the batch was already padded on (left for generation).

The new prompt's shape follows from host facts: every run's length and kept count (from image sizes and budgets)
and the batch row each run lies in (`PromptRuns`). The columns are then gathered on the prompt's device without a
host-device sync. Which row holds which image is written only in `input_ids`: a batch of several rows reads that
once per call (`read_layout`, together with whatever else the family needs on the host, e.g. image sizes); one row
needs no read at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.geometry.tables import repeated

POSITION_POLICIES = ("renumber", "original")


@dataclass
class CompressedPrompt:
    """The prompt after dropping. `index` [B, L'] maps each new column to its original column (-1 = new pad);
    `padded`: whether the new attention mask has zeros, as far as the host knows (None: one row, not read)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    labels: torch.Tensor | None
    index: torch.Tensor | None
    padded: bool | None = None

    @property
    def changed(self) -> bool:
        return self.index is not None


@dataclass(frozen=True)
class PromptRuns:
    """Host facts about one modality's placeholder runs in a prompt of `batch` rows.

    lengths: placeholders of every run (one per image or video, row-major); rows: the batch row of each run.
    right_padded: the batch is padded on the right (else on the left); padded: the attention mask has zeros (None:
    not read, one row). checked: the runs were checked against the prompt on the host (else the model's own check
    of placeholders against features catches a mismatch: the shrunk prompt then holds no placeholder at all).
    """

    lengths: list[int]
    rows: list[int]
    batch: int
    right_padded: bool = False
    padded: bool | None = None
    checked: bool = False


@dataclass
class HostLayout:
    """What a call reads back from the device once, before its encoder runs (see `read_layout`).

    per_row: placeholder id -> placeholders in every batch row (None: one row, nothing read); values: the family's
    inputs read as lists (e.g. `image_sizes`), by name.
    """

    batch: int
    per_row: dict[int, list[int]] | None = None
    right_padded: bool = False
    padded: bool | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def runs(self, placeholder_id: int, lengths: list[int], what: str = "image") -> PromptRuns:
        """The `PromptRuns` of runs of `lengths` placeholders of `placeholder_id`, row-major."""
        if self.per_row is None:
            return PromptRuns(list(lengths), [0] * len(lengths), self.batch)
        left = list(self.per_row[placeholder_id])
        found, expected = sum(left), sum(lengths)
        if found != expected:
            raise InputError(
                f"the prompt holds {found} {what} placeholder tokens but the {what}s produce {expected} visual "
                f"tokens ({len(lengths)} {what}(s)); pass input_ids made by the model's own processor from the same "
                f"{what}s"
            )
        rows, row = [], 0
        for length in lengths:
            while row < len(left) - 1 and left[row] <= 0:
                row += 1
            rows.append(row)
            left[row] -= length
        return PromptRuns(list(lengths), rows, self.batch, self.right_padded, self.padded, checked=True)


def read_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    placeholder_ids: list[int],
    values: dict[str, Any] | None = None,
    force: bool = False,
) -> HostLayout:
    """Read, in one read per device, what the host needs of a call's inputs: for a batch of several rows (or when
    `force`, or when a read happens anyway) the placeholders of each id in every row and whether the attention
    mask pads (and on which side); and `values`, tensors the family needs as lists (e.g. `image_sizes`; values
    that are not tensors pass as they are). A one-row call with nothing else to read reads nothing."""
    batch = input_ids.shape[0]
    values = dict(values or {})
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    layout = HostLayout(batch, values={k: v for k, v in values.items() if k not in tensors})
    if batch == 1 and not tensors and not force:
        return layout
    prompt = [(input_ids == i).sum(1) for i in placeholder_ids]
    if attention_mask is not None and batch > 1:  # the padding side and whether any: for re-padding rows
        zeros = attention_mask == 0
        prompt += [zeros[:, -1].any()[None].long(), zeros.any()[None].long()]
    parts = [("prompt", torch.cat(prompt) if len(prompt) > 1 else prompt[0] if prompt else None, input_ids.device)]
    parts += [(k, v, v.device) for k, v in tensors.items()]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor, device in parts:
        if tensor is not None:
            by_device.setdefault(device, []).append((name, tensor))
    read: dict[str, Any] = {}
    for items in by_device.values():
        flat = [t.reshape(-1).long() for _, t in items]
        flat = (torch.cat(flat) if len(flat) > 1 else flat[0]).tolist()  # one read per device
        for name, tensor in items:
            size = tensor.numel()
            read[name], flat = flat[:size], flat[size:]
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        layout.values[name] = _nest(read[name], shape)
    counts = read.get("prompt", [])
    layout.per_row = {i: counts[n * batch : (n + 1) * batch] for n, i in enumerate(placeholder_ids)}
    if attention_mask is not None and batch > 1:
        layout.right_padded, layout.padded = bool(counts[-2]), bool(counts[-1])
    elif batch > 1:
        layout.padded = False
    return layout


def _nest(flat: list[int], shape: tuple[int, ...]) -> Any:
    """A flat list as nested lists of `shape` (what `tensor.tolist()` gives)."""
    if len(shape) <= 1:
        return flat if shape else flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def gather_columns(x: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
    """x [..., B, L] gathered along the last dim with index [B, L'] (-1 -> fill), on x's device."""
    index = index.to(x.device)
    idx = index.clamp(min=0).expand(*x.shape[:-2], *index.shape)
    out = x.gather(-1, idx)
    return out.masked_fill(index < 0, fill)


def offset_tensors(keep: Sequence[int | torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Every run's kept offsets as a LongTensor on `device`: an int n stands for the run's first n (views of one
    `arange`, a single kernel for them all), a tensor is moved there."""
    first = torch.arange(max([k for k in keep if isinstance(k, int)] + [1]), device=device)
    return [k.to(device) if isinstance(k, torch.Tensor) else first[:k] for k in keep]


def placeholder_repeats(lengths: list[int], keep: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum(lengths)] how often each placeholder of the runs appears in the shrunk prompt: run i keeps its first
    `keep[i]` placeholders (an int; past the run's end its last placeholder repeats: a run can also grow) or those
    at the sorted offsets `keep[i]` (a LongTensor; offsets past the end likewise repeat the last one)."""
    if all(isinstance(k, int) for k in keep):
        cap = max([*lengths, *keep, 1])
        ones_then_zeros = (torch.arange(2 * cap, device=device) < cap).long()
        growth = [k - n + 1 for n, k in zip(lengths, keep, strict=True) if k > n]
        counts = torch.arange(max(growth) + 1, device=device) if growth else None
        parts = []
        for n, k in zip(lengths, keep, strict=True):
            if k <= n:
                parts.append(ones_then_zeros[cap - k : cap - k + n])
            else:
                parts += [ones_then_zeros[: n - 1], counts[k - n + 1 : k - n + 2]]
        return torch.cat(parts)
    offsets = offset_tensors(keep, device)
    sizes = [len(k) for k in offsets]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    picked = torch.minimum(torch.cat(offsets), repeated([n - 1 for n in lengths], sizes, device))
    picked = picked + repeated(starts, sizes, device)
    return torch.zeros(sum(lengths), dtype=torch.long, device=device).index_add_(0, picked, torch.ones_like(picked))


def shrink_prompt(
    input_ids: torch.Tensor,
    placeholder_id: int,
    runs: PromptRuns,
    keep: list[int | torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    pad_token_id: int = 0,
    positions: str = "renumber",
) -> CompressedPrompt:
    """Drop placeholder tokens so that run i keeps only `keep[i]` of its placeholders, without a host-device sync.

    input_ids: [B, L]; runs: the host facts of the placeholder runs (lengths in row-major order, rows).
    keep[i]: an int (the run's first keep[i] placeholders; for renumbered positions, where which ones does not
        matter) or a sorted LongTensor of kept offsets within the run; offsets at or past the run's end (renumbered
        positions only) add placeholders, for layouts longer than the processor's run.
    position_ids: [B, L] or [P, B, L] (multi-axis RoPE), or None.
    positions: "renumber" = kept tokens get contiguous positions (what the model sees is simply a shorter
        prompt); "original" = kept tokens keep the positions they had.
    The new shape comes from the host facts; the columns are gathered on the device of `input_ids`.
    """
    if positions not in POSITION_POLICIES:
        raise InputError(f"positions={positions!r}; expected one of {POSITION_POLICIES}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise InputError(
            f"a {attention_mask.dim()}-D attention_mask cannot be shrunk after token pruning; pass the usual "
            "2-D [batch, seq] padding mask (and a dynamic cache, not a static/compiled one)"
        )
    unchanged = CompressedPrompt(input_ids, attention_mask, position_ids, labels, None)
    kept = [k if isinstance(k, int) else len(k) for k in keep]
    if kept == list(runs.lengths):
        return unchanged

    device = input_ids.device
    batch, length = input_ids.shape
    row_lengths = [length] * batch
    for row, n, k in zip(runs.rows, runs.lengths, kept, strict=True):
        row_lengths[row] += k - n
    new_length = max(row_lengths)
    total = sum(runs.lengths)
    # how often each original column appears in the new prompt: text once, placeholders as `placeholder_repeats`
    is_placeholder = (input_ids == placeholder_id).flatten()
    ordinal = is_placeholder.cumsum(0) - 1  # each placeholder's place among all of them, row-major
    if len(keep) == 1 and isinstance(keep[0], int) and keep[0] <= total:  # one run keeping its first ones
        per_placeholder = ordinal < keep[0]
    else:
        per_placeholder = placeholder_repeats(runs.lengths, keep, device)[ordinal.clamp(0, max(total - 1, 0))]
    repeats = torch.where(is_placeholder, per_placeholder, 1).view(batch, length)
    ends = repeats.cumsum(1)  # [B, L] new columns up to and including each original column
    target = torch.arange(new_length, device=device).expand(batch, -1)
    if batch > 1 and not runs.right_padded:  # re-padded on the left: each row starts after its padding
        target = target - (new_length - ends[:, -1:])
    source = torch.searchsorted(ends, target.contiguous(), right=True)
    if batch > 1:  # rows shorter than the longest get new padding
        index = torch.where((target >= 0) & (source < length), source, -1)
        safe, missing = index.clamp(min=0), index < 0
    else:
        index, safe, missing = source, source, None
    # a prompt whose placeholders do not match the runs keeps none, so the model's own check fails
    mismatch = None if runs.checked else ordinal[-1] != total - 1

    def take(x: torch.Tensor, fill) -> torch.Tensor:
        taken = x.gather(-1, safe.expand(*x.shape[:-2], -1, -1))
        return taken if missing is None else taken.masked_fill(missing, fill)

    new_ids = take(input_ids, pad_token_id)
    if mismatch is not None:
        new_ids = new_ids.masked_fill(mismatch, pad_token_id)
    new_labels = take(labels, -100) if labels is not None else None
    uneven = len(set(row_lengths)) > 1
    if attention_mask is not None:
        new_mask = take(attention_mask, 0)
    elif batch > 1 and uneven:
        new_mask = (index >= 0).to(input_ids.dtype)
    else:
        new_mask = None
    # pads in the new prompt: known for several rows (read); one row's mask is not read, so positions are given
    # whenever it has a mask (the same as the model's own where the mask has no zeros)
    pads = bool(runs.padded) or uneven if batch > 1 else attention_mask is not None
    new_positions = None
    if position_ids is not None or positions == "original" or pads:
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        given = position_ids is not None
        if not given and positions == "original":
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if positions == "original":
            new_positions = take(position_ids, 0)
        else:  # contiguous from each row's first real position
            filled = new_mask if new_mask is not None else torch.ones_like(new_ids)
            rank = (filled.long().cumsum(-1) - 1).clamp(min=0)
            if given:
                first = (mask != 0).long().argmax(dim=1)  # [B]: each row's first real column
                first = first.view(*[1] * (position_ids.dim() - 2), -1, 1).expand(*position_ids.shape[:-1], 1)
                rank = position_ids.gather(-1, first) + rank
            new_positions = rank.masked_fill(filled == 0, 0)
    return CompressedPrompt(new_ids, new_mask, new_positions, new_labels, index, bool(runs.padded) or uneven)


def compress_prompt(
    input_ids: torch.Tensor,
    placeholder_id: int,
    run_lengths: list[int],
    keep_offsets: list[torch.Tensor | int],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    pad_token_id: int = 0,
    positions: str = "renumber",
) -> CompressedPrompt:
    """`shrink_prompt` for a prompt whose layout is read here (one read; adapters read it once per call instead):
    images own consecutive placeholders in row-major order, image i owning `run_lengths[i]`, and keeps
    `keep_offsets[i]` (sorted offsets within its run, or a count of its first ones)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise InputError(
            f"a {attention_mask.dim()}-D attention_mask cannot be shrunk after token pruning; pass the usual "
            "2-D [batch, seq] padding mask (and a dynamic cache, not a static/compiled one)"
        )
    layout = read_layout(input_ids, attention_mask, [placeholder_id], force=True)
    runs = layout.runs(placeholder_id, run_lengths)
    return shrink_prompt(input_ids, placeholder_id, runs, keep_offsets, attention_mask, position_ids, labels,
                         pad_token_id, positions)  # fmt: skip


def first_kept(lengths: list[int], device: torch.device | str) -> list[torch.Tensor]:
    """Per run, [n] offsets 0..n-1 (views of one arange on `device`)."""
    source = torch.arange(max([*lengths, 1]), device=device)
    return [source[:n] for n in lengths]
