"""Run a vtoken method on `VisualTokens` built from vLLM's features, and check counts against the placeholders.

The same calls vtoken's transformers adapters make (`Adapter.select`): lazy signals resolved here, "projected"
and "vision_features" filled when the method asks for them, the question as a `TextQuery`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vtoken.methods.base import EncoderMethod
from vtoken.tokens import Selection, TextQuery, VisualTokens


def select(
    method: EncoderMethod,
    tokens: VisualTokens,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    question: TextQuery | None = None,
) -> Selection:
    """`method.select(tokens)` with the signals it requires filled in."""
    requires = method.requires
    if "projected" in requires and "projected" not in tokens.signals and project is not None:
        tokens.signals["projected"] = lambda features=tokens.features: project(features)
    if "vision_features" in requires and "vision_features" not in tokens.signals:
        tokens.signals["vision_features"] = tokens.features
    if "question" in requires:
        tokens.question = question
    tokens.signals = {k: v() if callable(v) else v for k, v in tokens.signals.items()}
    return method.select(tokens)


def select_placed_offsets(method: EncoderMethod, placed: list[torch.Tensor]) -> list[torch.Tensor]:
    """A method acting on the tokens as placed (DivPrune): every image's run [L_i, D], as the LLM would receive it
    (projected, packed, newlines included) -> the offsets [k_i] of the rows it keeps, ascending. The call vtoken's
    transformers adapters make (`Adapter.select_placed`)."""
    lengths = [len(p) for p in placed]
    if not placed or not max(lengths):
        return [torch.arange(n) for n in lengths]
    width = max(lengths)
    features = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, width - len(p))) for p in placed])
    valid = torch.arange(width, device=features.device)[None] < torch.tensor(lengths, device=features.device)[:, None]
    selection = method.select(VisualTokens(features, (1, width), {}, torch.arange(len(placed)), valid))
    return [selection.kept_of(i) for i in range(len(placed))]


def select_placed(method: EncoderMethod, placed: list[torch.Tensor]) -> list[torch.Tensor]:
    """`select_placed_offsets`, the kept rows [k_i, D] of every run."""
    offsets = select_placed_offsets(method, placed)
    return [p[k.to(p.device)] for p, k in zip(placed, offsets, strict=True)]


def check_counts(method: EncoderMethod, produced: list[int], planned: list[int], where: str) -> None:
    """The encoder must fill exactly the placeholders the front end planned (a mismatch would shift the prompt)."""
    if produced != planned:
        raise RuntimeError(
            f"vtoken: {method.name} kept {produced} tokens per {where} but the prompt holds {planned} placeholders "
            "(sized before the encoder ran); please report this"
        )
