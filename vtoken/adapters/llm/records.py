"""The LLM stages' records, built when read: a drop leaves device tensors and host counts, and a record's `kept`
indices (a per-row boolean selection, which waits for the device) are only computed when someone reads them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vtoken.records import Record
from vtoken.timing import Stopwatch


class LazyRecord(Record):
    """A `Record` whose `kept` is computed on first read (from a `Deferred`), so a forward never waits for it."""

    @property
    def kept(self) -> torch.Tensor | None:
        value = self.__dict__.get("_kept")
        if isinstance(value, Deferred):
            value = self.__dict__["_kept"] = value()
        return value

    @kept.setter
    def kept(self, value: Any) -> None:
        self.__dict__["_kept"] = value


class Deferred:
    """One row's share of a computation made once for all rows, when the first of them is read."""

    def __init__(self, compute: Callable[[], list[torch.Tensor]], row: int, shared: dict | None = None):
        self.compute, self.row, self.shared = compute, row, shared if shared is not None else {}

    def __call__(self) -> torch.Tensor:
        if "rows" not in self.shared:
            self.shared["rows"] = self.compute()
        return self.shared["rows"][self.row]


class Elapsed:
    """Several steps' stopwatches read as one (`Record.timer`)."""

    def __init__(self) -> None:
        self.watches: list[Stopwatch] = []

    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.watches)


def kept_ranks(first_visual: torch.Tensor, column: torch.Tensor, merged: torch.Tensor | None, slots: torch.Tensor,
               keep: torch.Tensor):  # fmt: skip
    """A function giving, per row, the ranks among the row's visual prompt columns (`first_visual` [B, L]) of the
    visual slots `slots` [B, V] (-1: padding) that `keep` [B, V] marks, in a view whose slots hold prompt columns
    `column` [B, C] (`merged` [B, C]: tokens a method added, which have no rank). Nothing runs until it is called."""

    def compute() -> list[torch.Tensor]:
        columns = column.gather(1, slots.clamp(min=0)).masked_fill(slots < 0, -1)
        rank = first_visual.long().cumsum(1) - 1
        ranks = rank.gather(1, columns.clamp(min=0))
        chosen = keep & (columns >= 0) & (ranks >= 0)
        if merged is not None:
            chosen &= ~merged.gather(1, slots.clamp(min=0))
        return [ranks[row][chosen[row]] for row in range(ranks.shape[0])]

    return compute


def prefill_records(name: str, layer: int, counts: list[int], kept: list[int], added: list[int] | None,
                    compute: Callable[[], list[torch.Tensor]], timer: Stopwatch) -> list[Record]:  # fmt: skip
    """One record per row of a drop after `layer`: visual tokens in and out (host counts; merged tokens count in
    tokens_out and extra["merged"]), kept indices computed when read."""
    shared: dict = {}
    return [
        LazyRecord(f"prefill.layer{layer}", name, image=row, crop=0, tokens_in=n, tokens_out=kept[row] +
                   (added[row] if added else 0), kept=Deferred(compute, row, shared), grid=(1, n), timer=timer,
                   share=1 / len(counts), extra={"merged": added[row]} if added is not None else {})
        for row, n in enumerate(counts)
    ]  # fmt: skip
