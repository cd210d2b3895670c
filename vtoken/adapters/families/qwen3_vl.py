"""Qwen3-VL and Qwen3-VL-MoE (DeepStack), Qwen3.5 and Qwen3.5-MoE (the same tower without DeepStack).

As Qwen2-VL (see `qwen_vl.py`): visual tokens are the 2 x 2 merger outputs, per image and per temporal patch of
a video (two frames); kept tokens keep their original interleaved M-RoPE positions; `mm_token_type_ids` shrinks
with the prompt. Each video temporal patch is its own placeholder run after a `<t seconds>` timestamp; the runs
shrink independently and the timestamps stay. No [CLS]: [CLS] methods are refused at `patch`.

**DeepStack** (Qwen3-VL): ViT blocks `deepstack_visual_indexes` feed their own mergers, and those features are
added onto the visual positions after LLM layers 0..n-1. Each level follows the selection of the merged tokens
(the same kept indices, or the same fixed merge for pool/fourier), so the LLM adds each kept token's own DeepStack
features. A prefill drop inside the LLM (FastV) before the last DeepStack layer: the DeepStack features of the
tokens still in the sequence are added at their new slots (the model's `_deepstack_process` is wrapped on this
instance for the patch's lifetime).

**Qwen3.5** has a hybrid LLM (Gated DeltaNet linear attention in 3 of every 4 layers, with a recurrent state and
no KV cache): FastV drops after full-attention layers only, and every later layer, recurrent ones included, runs
on the shorter sequence (so the recurrent states are those of the kept tokens); see `Qwen35Adapter`.
"""

from __future__ import annotations

from typing import Any

import torch

from vtoken.errors import VTokenError

from .. import hf
from ..base import EncodedImages
from ..compiled import eager
from .qwen_vl import QwenVLAdapter


class Qwen3VLAdapter(QwenVLAdapter):
    family = "qwen3-vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    model_classes = (
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLModel",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLMoeModel",
    )
    frame_runs = True  # each temporal patch is its own run after a `<t seconds>` timestamp

    def companion_features(self, out: Any) -> list[torch.Tensor]:
        return list(getattr(out, "deepstack_features", None) or [])

    def encoder_output(self, encoded: EncodedImages, features: Any) -> Any:
        """The kept tokens and, per DeepStack level, each item's kept DeepStack features (the stock layout: a list
        over levels of per-item tensors)."""
        if not encoded.companions or not encoded.companions[0]:  # no DeepStack (Qwen3.5)
            return super().encoder_output(encoded, features)
        levels = [list(level) for level in zip(*encoded.companions, strict=True)]
        return hf.encoder_output(features, deepstack_features=levels)

    # ----------------------------------------------------------------- DeepStack inside a pruned prefill
    def install(self) -> None:
        super().install()
        if self.llm is not None and hasattr(self.language_model, "_deepstack_process"):
            # a bound method, not a closure: a patched model deep-copies and pickles
            self.language_model._deepstack_process = self._deepstack

    def remove(self) -> None:
        self.language_model.__dict__.pop("_deepstack_process", None)
        super().remove()

    @eager
    def _deepstack(self, hidden, visual_pos_masks, visual_embeds) -> torch.Tensor:
        """Add each remaining visual token's DeepStack features at its slot of a sequence shortened by a drop.

        hidden: [B, C, D] (C slots); visual_pos_masks: [B, L] the prompt's visual positions; visual_embeds:
        [V, D] their DeepStack features in row-major order."""
        lm = self.language_model
        stock = type(lm)._deepstack_process.__get__(lm)
        columns = self.llm.prefill_columns() if self.llm is not None else None
        if columns is None or hidden.shape[1] == visual_pos_masks.shape[1]:
            return stock(hidden, visual_pos_masks, visual_embeds)
        masks = visual_pos_masks.to(hidden.device)
        ordinal = (masks.flatten().long().cumsum(0) - 1).view_as(masks)  # [B, L] row of visual_embeds
        columns = columns.to(hidden.device)
        at = columns.clamp(min=0)
        visual = masks.gather(1, at) & (columns >= 0)  # [B, C] slots holding a visual token
        rows = ordinal.gather(1, at)[visual]
        hidden = hidden.clone()
        hidden[visual] = hidden[visual] + visual_embeds.to(hidden.device, hidden.dtype)[rows]
        return hidden


class Qwen35Adapter(Qwen3VLAdapter):
    """Qwen3.5 / Qwen3.5-MoE: the encoder stage as Qwen3-VL (no DeepStack). The LLM is hybrid: 3 of every 4
    decoder layers are Gated DeltaNet linear attention (a recurrent state, no KV cache, no attention rows). A
    prefill drop (FastV) may come after a full-attention layer only; the later layers, recurrent ones included,
    run on the shorter sequence, so their recurrent states are those of the kept tokens."""

    family = "qwen3.5"
    model_types = ("qwen3_5", "qwen3_5_moe")
    model_classes = (
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5Model",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeModel",
    )

    def validate(self) -> None:
        super().validate()
        prefill = self.prefill_method
        if prefill is not None:
            types = self.model.config.text_config.layer_types
            scored = prefill.scored_layers(len(types))
            linear = [i for i in scored if types[i] != "full_attention"]
            if linear:
                full = [i for i, kind in enumerate(types[:-1]) if kind == "full_attention"]
                where = "drop after" if scored == prefill.drop_layers(len(types)) else "score with"
                raise VTokenError(
                    f"{prefill.name}: layer(s) {linear} of {type(self.model).__name__}'s hybrid LLM are Gated DeltaNet "
                    f"linear attention (a recurrent state, no attention rows to score tokens with); {where} a "
                    f"full-attention layer: {full or 'none in this model leaves a later layer'}"
                )
            first = types.index("full_attention")  # transformers reads the cache length from its cache
            early = [i for i in prefill.drop_layers(len(types)) if i < first]
            if early:
                raise VTokenError(
                    f"{prefill.name}: a drop after layer(s) {early} of {type(self.model).__name__}'s hybrid LLM would "
                    f"shorten the cache of layer {first}, its first full-attention layer, from which the cache length "
                    f"(the next position) is read; drop after layer {first} or later"
                )
