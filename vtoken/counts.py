"""Visual-token counts: one definition for everything vtoken prints (CLI, demo, `vtoken eval`).

**Visual tokens are the image and video positions of the LLM's input sequence**: what the language model
receives. Unpatched, that is the prompt's placeholder tokens (on LLaVA-NeXT / OneVision the `image_newline`
separators included, since they reach the LLM too). Patched, it is measured, not inferred: the length of the
sequence the language model receives, minus the prompt's text tokens (text is never pruned). So the unpatched and
patched rows count the same input the same way.

Inside the LLM, prefill stages (FastV, MustDrop's LLM part, ...) drop visual tokens after a layer: those are
reported per stage as "after LLM layer K", not as the LLM's input. A stage that keeps every token (sparse
prefill, a budget of 1.0) reads "all N kept". KV-cache lengths (`decode.kv`) are cache entries, not visual tokens.
Encoder records count what a method chose among (a crop's patch tokens, newline separators and [CLS] excluded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .modelview import model_view
from .records import Record, llm_point_label


def placeholder_ids(model) -> list[int]:
    """The image/video placeholder token ids of `model` (one per modality its adapter knows)."""
    return sorted(set(model_view(model).placeholder_ids.values()))


def placeholders(model, input_ids: torch.Tensor) -> list[int]:
    """[B] visual placeholder tokens per row of a prompt: the visual tokens an unpatched model's LLM receives."""
    return model_view(model).visual_tokens(input_ids)


@contextmanager
def llm_input(model) -> Iterator[list[int]]:
    """Within the block, the per-row lengths (padding excluded) of the first sequence `model`'s language model
    receives (the prefill) are appended to the yielded list; later calls (decode steps) are ignored."""
    language_model = model_view(model).language_model
    lengths: list[int] = []

    def grab(module, args, kwargs):
        if lengths:
            return
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == embeds.shape[1]:
            lengths.extend(int(n) for n in mask.sum(dim=1).tolist())
        else:  # no 2-D padding mask: every row is the full length
            lengths.extend([int(embeds.shape[1])] * int(embeds.shape[0]))

    hook = language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        yield lengths
    finally:
        hook.remove()


def visual_in_llm(model, inputs, lengths: list[int]) -> list[int]:
    """[B] visual tokens the LLM received per row: the prompt's placeholders minus what the patch removed from the
    sequence (`lengths` from `llm_input`, against the prompt's own lengths)."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    prompt = mask.sum(dim=1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
    return [v - (p - n) for v, p, n in zip(placeholders(model, ids), prompt, lengths, strict=True)]


@dataclass
class VisualCounts:
    """One row's visual tokens under the definition above.

    unpatched: the prompt's visual tokens (the unpatched LLM's input). llm_input: those the patched LLM received.
    inside: (stage, tokens after it) of every prefill stage, in the order they ran (FastV's "prefill.layer2").
    """

    unpatched: int
    llm_input: int
    inside: list[tuple[str, int]] = field(default_factory=list)

    def text(self) -> str:
        """'2928 -> 744 (25.4% kept)', 'all 576 kept', then '; after LLM layer 2: 288' for prefill stages."""
        if self.llm_input == self.unpatched:
            out = f"all {self.unpatched} kept"
        else:
            out = f"{self.unpatched} -> {self.llm_input} ({self.llm_input / max(self.unpatched, 1):.1%} kept)"
        for stage, n in self.inside:
            out += f"; {llm_point_label(stage)}: {n}"
        return out


def inside_llm(records: list[Record], row: int | None = None) -> list[tuple[str, int]]:
    """(stage, visual tokens after it) of every prefill stage in `records` (one row's, or summed over rows)."""
    stages = dict.fromkeys(r.stage for r in records if r.stage.startswith("prefill."))
    return [(s, sum(r.tokens_out for r in records if r.stage == s and (row is None or r.image == row)))
            for s in stages]  # fmt: skip


def count(model, inputs, lengths: list[int], records: list[Record], row: int = 0) -> VisualCounts:
    """Row `row`'s `VisualCounts` from a patched call: `lengths` from `llm_input` around it, its records."""
    unpatched = placeholders(model, inputs["input_ids"])[row]
    return VisualCounts(unpatched, visual_in_llm(model, inputs, lengths)[row], inside_llm(records, row))
