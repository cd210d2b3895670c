"""Tiny offline models of the transformers VLMs built on timm towers (`TimmWrapperModel`): FastVLM and PerceptionLM.

Built from configs as the real checkpoints are (a `TimmWrapperConfig` naming the timm architecture, with
`model_args` shrinking it; random weights, nothing downloaded), with the tiny BPE tokenizer of `vtoken.parts`.
"""

from __future__ import annotations

import torch

from ..parts import LLAVA_CHAT_TEMPLATE, tiny_tokenizer
from .common import _instantiate, _with_tokenizer, tiny_text

# FastViT-MCi3 cut to one block per stage and narrow widths: still stem stride 4, four stride-2 stages (feature
# stride 64), repmixer stages then two attention stages, and a final conv doubling the last width
FASTVIT_TINY = {
    "inference_mode": True,
    "layers": (1, 1, 1, 1, 1),
    "embed_dims": (8, 16, 16, 32, 32),
    "mlp_ratios": (2, 2, 2, 2, 2),
}


@_with_tokenizer
def tiny_fastvlm(seed: int = 0, image_size: int = 384):
    """A tiny random-weight FastVLM: timm `fastvit_mci3` (narrow, one block per stage; stride 64, so 6 x 6 = 36
    tokens at 384 px, no [CLS]) + MLP projector + Qwen2, with a LLaVA-style processor (`LlavaProcessor`)."""
    from transformers import CLIPImageProcessor, FastVlmConfig, FastVlmForConditionalGeneration, LlavaProcessor

    tokenizer = tiny_tokenizer()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        ),
        tokenizer=tokenizer,
        patch_size=64,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    vision = {
        "model_type": "timm_wrapper",
        "architecture": "fastvit_mci3",
        "do_pooling": False,
        "hidden_size": 2 * FASTVIT_TINY["embed_dims"][-1],
        "model_args": dict(FASTVIT_TINY),
    }
    text = tiny_text(tokenizer, model_type="qwen2")
    config = FastVlmConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _instantiate(FastVlmForConditionalGeneration, config, tokenizer, seed)
    # transformers' weight init shrinks FastViT's activations ~1e4-fold per stage (features ~1e-22: every selection
    # a tie, every pruning the same logits); PyTorch's default init of the tower keeps them O(0.1)
    torch.manual_seed(seed)
    for module in model.model.vision_tower.timm_model.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.BatchNorm2d)):
            module.reset_parameters()
    return model, processor


@_with_tokenizer
def tiny_perception_lm(seed: int = 0, tile_size: int = 128):
    """A tiny random-weight PerceptionLM: timm PE (`vit_pe_core_tiny_patch16_384` cut to 2 blocks, 32 wide:
    [CLS], 2-D RoPE, 8 x 8 patches per 128-px tile) + MLP projector with 2 x 2 adaptive average pooling (4 x 4 =
    16 tokens per tile) + Llama. Images: a thumbnail plus up to 4 tiles; videos: one tile per frame."""
    from transformers import (
        PerceptionLMConfig,
        PerceptionLMForConditionalGeneration,
        PerceptionLMImageProcessor,
        PerceptionLMProcessor,
        PerceptionLMVideoProcessor,
    )

    tokenizer = tiny_tokenizer(("<image>", "<video>"), named={"image_token": "<image>", "video_token": "<video>"})
    processor = PerceptionLMProcessor(
        image_processor=PerceptionLMImageProcessor(tile_size=tile_size, max_num_tiles=4),
        video_processor=PerceptionLMVideoProcessor(size={"height": tile_size, "width": tile_size}),
        tokenizer=tokenizer,
        patch_size=16,
        pooling_ratio=2,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    vision = {
        "model_type": "timm_wrapper",
        "architecture": "vit_pe_core_tiny_patch16_384",
        "do_pooling": False,
        "hidden_size": 32,
        "model_args": {
            "embed_dim": 32,
            "depth": 2,
            "num_heads": 2,
            "img_size": (tile_size, tile_size),
            "ref_feat_shape": (tile_size // 16, tile_size // 16),
            "global_pool": "",
            "use_post_transformer_norm": False,
        },
    }
    text = tiny_text(tokenizer, model_type="llama")
    config = PerceptionLMConfig(
        vision_config=vision,
        text_config=text,
        vision_use_cls_token=True,
        projector_pooling_ratio=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return _instantiate(PerceptionLMForConditionalGeneration, config, tokenizer, seed), processor
