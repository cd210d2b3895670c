"""Shrinking the placeholder runs of a tokenized prompt after visual tokens were dropped.

The model checks that the number of image placeholders equals the number of visual features, so every dropped
token takes its placeholder with it, and the attention mask, labels and position ids follow. Rows that lose
different numbers of tokens are re-padded on the side the batch was already padded on (left for generation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtoken.errors import InputError

POSITION_POLICIES = ("renumber", "original")


@dataclass
class CompressedPrompt:
    """The prompt after dropping. `index` [B, L'] maps each new column to its original column (-1 = new pad)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    labels: torch.Tensor | None
    index: torch.Tensor | None

    @property
    def changed(self) -> bool:
        return self.index is not None


def gather_columns(x: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
    """x [..., B, L] gathered along the last dim with index [B, L'] (-1 -> fill), on x's device."""
    index = index.to(x.device)
    idx = index.clamp(min=0).expand(*x.shape[:-2], *index.shape)
    out = x.gather(-1, idx)
    return out.masked_fill(index < 0, fill)


def compress_prompt(
    input_ids: torch.Tensor,
    placeholder_id: int,
    run_lengths: list[int],
    keep_offsets: list[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    pad_token_id: int = 0,
    positions: str = "renumber",
) -> CompressedPrompt:
    """Drop placeholder tokens so that image i keeps only the placeholders at `keep_offsets[i]` of its run.

    input_ids: [B, L]; images own consecutive placeholders in row-major order, image i owning `run_lengths[i]`.
    keep_offsets[i]: sorted LongTensor of kept offsets within image i's run; offsets at or past the run's end
        (renumbered positions only) add placeholders, for layouts longer than the processor's run.
    position_ids: [B, L] or [P, B, L] (multi-axis RoPE), or None.
    positions: "renumber" = kept tokens get contiguous positions (what the model sees is simply a shorter
        prompt); "original" = kept tokens keep the positions they had.
    The index arithmetic runs on the host (these are small integer tensors, and data-dependent shapes on an
    accelerator would mean several synchronisations); results go back to the device of `input_ids`.
    """
    if positions not in POSITION_POLICIES:
        raise InputError(f"positions={positions!r}; expected one of {POSITION_POLICIES}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise InputError(
            f"a {attention_mask.dim()}-D attention_mask cannot be shrunk after token pruning; pass the usual "
            "2-D [batch, seq] padding mask (and a dynamic cache, not a static/compiled one)"
        )
    device = input_ids.device
    if device.type != "cpu":

        def host(t):
            return None if t is None else t.cpu()

        def back(t):
            return None if t is None else t.to(device, non_blocking=True)

        out = compress_prompt(
            host(input_ids),
            placeholder_id,
            run_lengths,
            [k.cpu() for k in keep_offsets],
            attention_mask=host(attention_mask),
            position_ids=host(position_ids),
            labels=host(labels),
            pad_token_id=pad_token_id,
            positions=positions,
        )
        if not out.changed:
            return CompressedPrompt(input_ids, attention_mask, position_ids, labels, None)
        return CompressedPrompt(*(back(t) for t in (out.input_ids, out.attention_mask, out.position_ids,
                                                    out.labels, out.index)))  # fmt: skip
    is_placeholder = input_ids == placeholder_id
    found, expected = int(is_placeholder.sum()), sum(run_lengths)
    if found != expected:
        raise InputError(
            f"the prompt holds {found} image placeholder tokens but the images produce {expected} visual tokens "
            f"({len(run_lengths)} image(s)); pass input_ids made by the model's own processor from the same images"
        )
    unchanged = CompressedPrompt(input_ids, attention_mask, position_ids, labels, None)
    if all(len(k) == n for k, n in zip(keep_offsets, run_lengths, strict=True)):
        return unchanged

    batch, length = input_ids.shape
    # how often each original column appears in the new prompt: text once, placeholders as often as their
    # offset is listed (offsets past the end of a run repeat its last placeholder: a run can also grow)
    repeats = (~is_placeholder).long().flatten()
    counts = [
        torch.bincount(k.to(device).clamp(max=n - 1), minlength=n)
        for k, n in zip(keep_offsets, run_lengths, strict=True)
    ]
    repeats[is_placeholder.flatten()] = torch.cat(counts)
    repeats = repeats.view(batch, length)
    lengths = repeats.sum(1)
    new_len = int(lengths.max())
    source = torch.repeat_interleave(torch.arange(length, device=device).repeat(batch), repeats.flatten())
    rows = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    rank = torch.arange(len(source), device=device) - (lengths.cumsum(0) - lengths)[rows]
    right_padded = attention_mask is not None and bool((attention_mask[:, -1] == 0).any())
    shift = torch.zeros_like(lengths) if right_padded else new_len - lengths
    index = torch.full((batch, new_len), -1, dtype=torch.long, device=device)
    index[rows, rank + shift[rows]] = source

    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    new_mask = gather_columns(mask, index, 0)
    new_ids = gather_columns(input_ids, index, pad_token_id)
    new_labels = gather_columns(labels, index, -100) if labels is not None else None

    new_positions = None
    if position_ids is not None or positions == "original" or bool((new_mask == 0).any()):
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if positions == "original":
            new_positions = gather_columns(position_ids, index, 0)
        else:  # contiguous from each row's first real position
            first = (mask != 0).long().argmax(dim=1)  # [B]: each row's first real column
            first = first.view(*[1] * (position_ids.dim() - 2), -1, 1).expand(*position_ids.shape[:-1], 1)
            start = position_ids.gather(-1, first)
            rank = (new_mask.long().cumsum(-1) - 1).clamp(min=0)
            new_positions = (start + rank).masked_fill(new_mask == 0, 0)
    new_mask = new_mask if attention_mask is not None or bool((new_mask == 0).any()) else None
    return CompressedPrompt(new_ids, new_mask, new_positions, new_labels, index)


def run_rows(input_ids: torch.Tensor, placeholder_id: int, run_lengths: list[int]) -> list[int]:
    """The batch row of every placeholder run (runs in row-major order, run i holding `run_lengths[i]`)."""
    left = (input_ids == placeholder_id).sum(1).tolist()
    rows, row = [], 0
    for length in run_lengths:
        while row < len(left) - 1 and left[row] <= 0:
            row += 1
        rows.append(row)
        left[row] -= length
    return rows
