"""The tower stage in vLLM: PixelPrune on Qwen2.5-VL and Qwen3-VL, its vision tower run on the kept merge groups only.

A tower method acts before or inside the vision tower (METHODS-4-tower.md). PixelPrune's count per image follows
from the preprocessed pixels, which the processor holds, so the processor sizes the image's placeholders from it
(`counts`), the M-RoPE positions are the stock ones at the kept groups (`kept_offsets`, the same selection on the
same pixels), and the engine runs vLLM's own Qwen-VL tower on the kept groups' pixel rows only (`pruned_tower`):
its forward takes precomputed tables (`encoder_metadata`, which vLLM builds for its encoder CUDA graphs), so the
plugin hands it the tables of the kept rows, built as `vtoken.adapters.tower.qwen_tables` builds them for
transformers (`vtoken.geometry.tower`): Qwen2.5-VL's rotary cos/sin in window order of the kept groups, windows
from the full grid restricted to the kept groups, per-image `cu_seqlens`; Qwen3-VL's interpolated position
embeddings and rotary of the kept rows (gathered from the full-grid tables vLLM computes), per-image
`cu_seqlens`. The tower's output is every image's kept groups' merged features, ascending (Qwen3-VL: with its
DeepStack levels, computed from the pruned states, as on transformers).

ToMe on LLaVA-1.5 is `vtoken.serving.vllm.tome`. Elsewhere a tower method is refused at start (`check`), naming
why, and so is a tower method composed with an encoder method (`config`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vtoken.geometry import tower as tables
from vtoken.methods.base import TowerMethod, TowerShape
from vtoken.methods.pixelprune import Selected, to_device
from vtoken.stages.tower import TowerStage

from .config import ServingConfig, error

# the families whose vLLM towers the plugin runs a tower method in, and how it acts there ("input": PixelPrune,
# "layers": ToMe)
SERVED = {"qwen2.5-vl": "input", "qwen3-vl": "input", "llava-1.5": "layers"}
WHY_NOT = {
    ("llava-1.5", "input"): "it would run vLLM's CLIP tower on [CLS] and each image's kept patches, a different "
    "number per image, so a batch of images needs padding with a key mask, and vLLM's CLIP attention "
    "(`MMEncoderAttention`) takes no mask; its tower builds every patch's embedding inside its forward",
    ("llava-next", "input"): "it would run vLLM's CLIP tower on [CLS] and each crop's kept patches, a different "
    "number per crop, so the crops need padding with a key mask, which vLLM's CLIP attention (`MMEncoderAttention`) "
    "does not take",
    ("llava-next", "layers"): "on LLaVA-NeXT its merged crops go to the LLM in the flat layout (base crop, then "
    "grid crops, no unpadding or newlines), which the plugin's LLaVA-NeXT path (its official and native layouts) "
    "does not pack yet; it is served on LLaVA-1.5",
    # OneVision's tower methods take the flat layout (every crop alike, no unpadding, downsampling or newline)
    ("llava-onevision", "input"): "on LLaVA-OneVision its kept patches go to the LLM in the flat layout (every crop "
    "alike, no unpadding, downsampling or newline), and the plugin does not serve LLaVA-OneVision at all yet",
    ("llava-onevision", "layers"): "on LLaVA-OneVision its merged crops go to the LLM in the flat layout (every "
    "crop alike, no unpadding, downsampling or newline), and the plugin does not serve LLaVA-OneVision at all yet",
}


def check(config: ServingConfig, family: str) -> None:
    """Refuse at start a tower method this family's vLLM tower cannot take, naming why (after the method's own
    family check, which names its refusals on transformers too)."""
    method = config.tower
    if method is None:
        return
    try:
        TowerStage.check_family(method, family)
    except Exception as failure:  # noqa: BLE001 - the plugin's errors name vtoken
        raise error(str(failure)) from None
    if SERVED.get(family) != method.acts:
        served = ", ".join(f"{f} ({'pixelprune' if a == 'input' else 'tome'})" for f, a in SERVED.items())
        why = WHY_NOT.get((family, method.acts), "the plugin does not run it in this family's vLLM tower")
        raise error(
            f"{method.name} is not served on {family} in vLLM: {why}. Tower methods served: {served}; use "
            "vtoken.patch on transformers for this one"
        )


@dataclass(frozen=True)
class InputTower:
    """A tower method acting on the input rows of a Qwen-VL tower in vLLM: the method, the tower's `TowerShape`
    (normalised as the processor that made the pixels), and that processor's rescale factor."""

    method: TowerMethod
    shape: TowerShape
    rescale: float

    def select(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> Selected:
        """The kept units of images `grids` from their processed pixels [S, D] (the tower stage's `select`, the
        method's `select_input`; on the CPU, where
        vLLM's processor leaves them, no device sync). vLLM's processor may leave the pixels raw (uint8: with
        `mm_device_do_normalize`, the tower's `input_norm` rescales and normalises them on the device): then the
        unit values are the rescaled bytes themselves (x * rescale, in [0, 1]), which is what vtoken de-normalises
        the float pixels back to on transformers (equal up to rounding in the last bit)."""
        shape = self.shape
        if not pixels.is_floating_point():
            pixels = pixels.float() * self.rescale
            shape = replace(shape, mean=(0.0,) * shape.channels, std=(1.0,) * shape.channels)
        return TowerStage(self.method, shape).select(pixels, grids)[0]


def qwen_input_tower(method: TowerMethod, hf_config: Any, family: str, image_processor: Any) -> InputTower:
    """`InputTower` of a Qwen-VL config (its `TowerShape` as `vtoken.adapters.tower.tower_shape` makes it),
    normalised as `image_processor` (the one that makes the pixels) normalises."""
    vision = hf_config.vision_config
    channels = vision.in_channels

    def per_channel(value: Any) -> tuple[float, ...]:
        values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * channels
        return tuple(values)

    mean, std = per_channel(image_processor.image_mean), per_channel(image_processor.image_std)
    shape = TowerShape(family, cls=False, feature_block=vision.depth - 1, merge=vision.spatial_merge_size,
                       patch=vision.patch_size, temporal=vision.temporal_patch_size, channels=channels, mean=mean,
                       std=std)  # fmt: skip
    return InputTower(method, shape, float(getattr(image_processor, "rescale_factor", 1 / 255)))


def grid_of(grid_thw: torch.Tensor) -> tuple[int, int, int]:
    """One image's (t, h, w) patches as host ints (vLLM keeps the grids on the CPU)."""
    t, h, w = (int(x) for x in grid_thw.tolist())
    return t, h, w


def _sequences(visual: Any, cumulative: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(cu_seqlens, max_seqlen, sequence_lengths) of cumulative row counts [n + 1] int32, as vLLM's
    `prepare_encoder_metadata` makes them for its attention backend."""
    from vllm.model_executor.layers.attention import MMEncoderAttention

    backend = visual.attn_backend
    lengths = MMEncoderAttention.maybe_compute_seq_lens(backend, cumulative, device)
    longest = torch.tensor(MMEncoderAttention.compute_max_seqlen(backend, cumulative), dtype=torch.int32)
    cu_seqlens = MMEncoderAttention.maybe_recompute_cu_seqlens(
        backend, cumulative, visual.hidden_size, visual.tp_size, device,
        fp8_padded_hidden_size=visual.fp8_padded_hidden_size,
    )  # fmt: skip
    return cu_seqlens, longest, lengths


def qwen25_metadata(visual: Any, grids: list[tuple[int, int, int]], selected: Selected) -> dict[str, Any]:
    """vLLM Qwen2.5-VL tower tables for the kept groups: rotary cos/sin [4K, d] in the kept groups' window order,
    `window_index` [K] (kept groups in window order) and its inverse, per-image `cu_seqlens` and the windows of the
    full grid restricted to the kept groups (empty ones dropped)."""
    device, merge = visual.device, visual.spatial_merge_size
    cos, sin = zip(*(visual.rotary_pos_emb_thw(t, h, w) for t, h, w in grids), strict=True)  # [G, 4, d] each
    order, windows, _ = tables.windows(selected.kept, grids, merge, visual.window_size, visual.patch_size)
    groups = to_device(selected.kept[order], cos[0].device)  # the kept groups, in window order
    full, longest, lengths = _sequences(visual, tables.cu_seqlens(selected.counts, merge)[0], device)
    windowed, widest, window_lengths = _sequences(visual, windows, device)
    return {
        "rotary_pos_emb_cos": torch.cat(cos)[groups].flatten(0, 1).to(device),
        "rotary_pos_emb_sin": torch.cat(sin)[groups].flatten(0, 1).to(device),
        "window_index": to_device(order, device),
        "reverse_indices": to_device(np.argsort(order, kind="stable"), device),
        "cu_seqlens": full,
        "cu_window_seqlens": windowed,
        "max_seqlen_full": longest,
        "max_seqlen_window": widest,
        "sequence_lengths_full": lengths,
        "sequence_lengths_window": window_lengths,
    }


def qwen3_metadata(visual: Any, grids: list[tuple[int, int, int]], selected: Selected) -> dict[str, Any]:
    """vLLM Qwen3-VL tower tables for the kept rows: the interpolated position embeddings and rotary cos/sin of
    the full grids (vLLM's own arithmetic) gathered at the kept rows [4K, ...], per-image `cu_seqlens`."""
    device, merge = visual.device, visual.spatial_merge_size
    stock = visual.prepare_encoder_metadata([list(g) for g in grids])
    rows = to_device(tables.kept_rows(selected.kept, merge), device)
    cu_seqlens, longest, lengths = _sequences(visual, tables.cu_seqlens(selected.counts, merge)[0], device)
    return {
        "pos_embeds": stock["pos_embeds"][rows],
        "rotary_pos_emb_cos": stock["rotary_pos_emb_cos"][rows],
        "rotary_pos_emb_sin": stock["rotary_pos_emb_sin"][rows],
        "cu_seqlens": cu_seqlens,
        "max_seqlen": longest,
        "sequence_lengths": lengths,
    }


def pruned_tower(visual: Any, family: str, pixels: torch.Tensor, grids: list[tuple[int, int, int]],
                 selected: Selected) -> torch.Tensor:  # fmt: skip
    """vLLM's Qwen-VL tower run on the kept groups of `selected` only: pixels [S, D] of images `grids` as the
    processor made them -> [sum of kept, D'] every image's kept groups' merged features, image after image,
    ascending (Qwen3-VL: D' includes the DeepStack levels)."""
    rows = to_device(tables.kept_rows(selected.kept, visual.spatial_merge_size), pixels.device)
    metadata = qwen25_metadata if family == "qwen2.5-vl" else qwen3_metadata
    return visual(pixels[rows], grid_thw=None, encoder_metadata=metadata(visual, grids, selected))
