"""LLaVA-1.5 geometry: one square crop per image, an H x W token grid read from a CLIP tower with [CLS].

`token_grid` (the grid of a tower config), `encoder_layer` (which encoder layer's output a `vision_feature_layer`
index is, the layer whose attention a [CLS] score reads) and `outside_pad_border` (the patches of a pad-to-square
border, read from the pixels), shared by the transformers adapter and the vLLM plugin.
"""

from __future__ import annotations

import torch


def token_grid(image_size: int, patch_size: int) -> tuple[int, int]:
    """(H, W) tokens of a square crop of `image_size` pixels cut into `patch_size` patches."""
    side = image_size // patch_size
    return side, side


def encoder_layer(hidden_state_index: int, num_layers: int) -> int | None:
    """Index of the encoder layer whose output is `hidden_states[hidden_state_index]` of a tower of `num_layers`
    layers (negative indices from the end; None = the embeddings)."""
    layer = hidden_state_index % (num_layers + 1) - 1
    return None if layer < 0 else layer


def outside_pad_border(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, N] bool: False for patches lying wholly in a pad-to-square border of crops [C, 3, H, W].

    The border is what `LlavaImageProcessor(do_pad=True)` (the original LLaVA-1.5 preprocessing) adds: whole
    pixel rows (or columns) at the edges, all of the corner pixel's colour. It is read from the pixels, since
    the model never sees the image size: the resize after padding blends the innermost pad row with the photo,
    so a patch straddling that row is kept as content. A crop without a border (e.g. center cropped, or an
    image of a single colour) has every patch valid.
    """
    same = (pixel_values == pixel_values[:, :, :1, :1]).all(1)  # [C, H, W] pixels of the corner's colour
    rows, cols = same.all(-1), same.all(-2)  # [C, H], [C, W] uniform pixel rows / columns

    def edge_run(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flags.long().cumprod(-1).sum(-1), flags.flip(-1).long().cumprod(-1).sum(-1)

    (top, bottom), (left, right) = edge_run(rows), edge_run(cols)
    height, width = pixel_values.shape[-2:]
    start_y = torch.arange(0, height, patch, device=pixel_values.device)
    start_x = torch.arange(0, width, patch, device=pixel_values.device)
    pad_y = (start_y + patch <= top[:, None]) | (start_y >= height - bottom[:, None])  # [C, H/p]
    pad_x = (start_x + patch <= left[:, None]) | (start_x >= width - right[:, None])  # [C, W/p]
    pad = (pad_y[:, :, None] | pad_x[:, None, :]).flatten(1)
    return ~pad | pad.all(1, keepdim=True)
