"""The tower stage: one method acting before or inside the vision tower, the same checks and counts for every caller.

A tower method (`vtoken.methods.base.TowerMethod`, METHODS-4-tower.md) makes the tower itself run on fewer tokens:
PixelPrune drops merge groups (or patches) that the pixels already predict before block 0 (`acts = "input"`), ToMe
merges tokens inside the blocks (`acts = "layers"`). This module is what every caller shares, model-agnostic: the
checks at `patch` (the method's families, its composition with an encoder-stage method), the refusal of inputs it
does not act on when a call starts, its count before encoding (from host integers, or from the preprocessed pixels
before any model compute), PixelPrune's selection of the units, and the records. The transformers side (ToMe's
blocks, the Qwen tower run on the kept groups, CLIP's kept patches) is `vtoken.adapters.tower`; the vLLM plugin
(`vtoken.serving.vllm.tower`, `.tome`) checks the family here, sizes its placeholders from `TowerStage.counts`
(ToMe) or PixelPrune's `select` on the processor's pixels, and runs vLLM's towers on what it decided.

Composition: tower -> encoder -> prefill/decode/sparse. The encoder method sees the tower's output as its crop:
after a tower that keeps the grid (PixelPrune), the crop's full grid with the dropped units invalid, so its kept
indices are the crop's own (a subset of the tower's kept units; methods that need the "grid" signal, a rectangle
of valid tokens, are refused); after ToMe, the N' merged tokens of the crop as a
1 x N' row (no grid), so its kept indices index the merged tokens (`sources` in the tower record map every patch
to them). Its budget counts over what the tower left. When no encoder method is given, `KeepAll` stands in for it:
every token the tower left reaches the LLM, and it records nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtoken.errors import InputError, MissingSignalError, VTokenError
from vtoken.methods.base import EncoderMethod, Method, TowerMethod, TowerShape, unmet
from vtoken.timing import Stopwatch
from vtoken.tokens import Selection, VisualTokens

from .encoder import COMMON_SIGNALS, keep_all


@dataclass
class KeepAll(EncoderMethod):
    """The encoder stage's method when a tower method acts without one: every valid token the tower left goes on,
    in order. Not a registered method (the registry never sees it); it records nothing (`recorded`)."""

    budget: Any = 1.0

    name = "keep_all"
    recorded: ClassVar[bool] = False

    def select(self, tokens: VisualTokens) -> Selection:
        return keep_all(tokens)


# signals a family computes on the tower's output tokens themselves, and so serves after any tower method
OUTPUT_SIGNALS = frozenset({"patch_features"})


class TowerStage:
    """The tower stage of one method on one tower (`shape`, which the caller reads from its model at `patch`)."""

    def __init__(self, method: TowerMethod, shape: TowerShape):
        self.method = method
        self.shape = shape

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def acts(self) -> str:
        """ "input" (drops rows before block 0) or "layers" (changes the sequence inside the blocks)."""
        return self.method.acts

    @property
    def keeps_grid(self) -> bool:
        """The tokens leaving the tower keep the crop's token grid (the dropped ones marked invalid)."""
        return self.method.keeps_grid

    # ----------------------------------------------------------------- checks before anything runs
    @staticmethod
    def check_family(method: TowerMethod, family: str) -> None:
        """Refuse a tower method on a family it cannot act in, naming why (the spec's refusals), before the model
        is read or touched."""
        method.check_family(family)

    def check_encoder(self, encoder: Method | None, served: set[str], owner: str) -> None:
        """Refuse, at `patch`, an encoder-stage method that cannot follow this tower method: one that merges inside
        the tower itself (MustDrop), or one needing signals that do not exist on the tower's output (`served`: what
        the family computes there; grid signals only where the tower keeps the grid)."""
        if encoder is None or isinstance(encoder, KeepAll):
            return
        if "tower_merge" in encoder.requires:
            raise VTokenError(
                f"{encoder.name} merges tokens inside the vision tower, where {self.name} already acts (a tower "
                f"method {'merges' if self.acts == 'layers' else 'drops rows'} there); combine {self.name} with an "
                "encoder method that selects among the tower's output tokens, or use one of them alone"
            )
        available = set(served) | set(COMMON_SIGNALS)
        missing = unmet(tuple(encoder.requires), available)
        if missing:
            why = (
                "its merged tokens have no place on the crop's grid and no attention row of their own"
                if self.acts == "layers"
                else "the tower runs on the kept units only"
            )
            raise MissingSignalError(
                f"{encoder.name} needs the signal(s) {missing}, which {owner} cannot provide after {self.name} "
                f"({why}); after {self.name} it provides {sorted(available)}"
            )

    def check_call_modality(self, modality: str, pixel_key: str, why: str = "") -> None:
        """At a call's start: refuse inputs the method does not act on (videos), before anything runs; `why`: the
        family's reason, where it has one (OneVision: its frames are pooled after the tower)."""
        if modality not in self.method.modalities:
            because = f" ({why})" if why else ""
            raise InputError(
                f"{self.name} acts in the vision tower on {' and '.join(self.method.modalities)} inputs only; this "
                f"call passes {modality}s (`{pixel_key}`){because}: call the model without them, or unpatch for them"
            )

    # ----------------------------------------------------------------- per call
    def counts(self, grids: Iterable[tuple[int, ...]], pixels: torch.Tensor | None = None) -> list[int]:
        """Tokens leaving the tower per crop (LLM-level tokens), before any model compute (`count_before_encoding`:
        host integers for ToMe; the preprocessed pixels for PixelPrune, one read of its kept mask unless they are on
        the CPU)."""
        return self.method.count_before_encoding(list(grids), pixels, self.shape)

    def select(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> tuple[Any, Stopwatch]:
        """An input method's units to keep (`select_input`: a `Selected`, host counts and kept units), and the time
        it took."""
        timer = Stopwatch(pixels.device).start()
        selected = self.method.select_input(pixels, grids, self.shape)
        timer.stop()
        return selected, timer
