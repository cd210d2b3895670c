"""Tiny random-weight LLaVA-family models: LLaVA-1.5, LLaVA-NeXT (anyres), LLaVA-NeXT-Video, Video-LLaVA and
LLaVA-OneVision (the real transformers classes and processors at tiny widths)."""

from __future__ import annotations

import torch

from ..parts import LLAVA_CHAT_TEMPLATE, llava_config, llava_processor, tiny_tokenizer
from .common import TINY_TEXT, TINY_VISION, _instantiate, _with_tokenizer


@_with_tokenizer
def tiny_llava(seed: int = 0, image_size: int = 336, patch_size: int = 14, text_layers: int = 2):
    """A tiny random-weight LLaVA-1.5: CLIP ViT (3 layers, [CLS], 24x24 grid) + MLP projector + Llama
    (`text_layers` layers, default 2)."""
    from transformers import LlavaForConditionalGeneration

    tokenizer = tiny_tokenizer()
    processor = llava_processor(tokenizer, image_size, patch_size)
    config = llava_config(
        tokenizer,
        vision=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, projection_dim=32
        ),
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=text_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        image_size=image_size,
        patch_size=patch_size,
    )
    return _instantiate(LlavaForConditionalGeneration, config, tokenizer, seed), processor


ANYRES_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


@_with_tokenizer
def tiny_llava_next(seed: int = 0, video: bool = False):
    """A tiny random-weight LLaVA-NeXT: anyres crops (LLaVA-NeXT's 5 grid pinpoints), CLIP with [CLS], newline.
    With `video`, LLaVA-NeXT-Video: the same plus per-frame video tokens through a stride-2 resampler."""
    import transformers

    prefix = "LlavaNextVideo" if video else "LlavaNext"
    specials, named = ("<image>",), {"image_token": "<image>"}
    if video:
        specials, named = ("<image>", "<video>"), {"image_token": "<image>", "video_token": "<video>"}
    tokenizer = tiny_tokenizer(specials, named=named)
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_grid_pinpoints=ANYRES_PINPOINTS
    )
    extra = {}
    if video:
        extra["video_processor"] = transformers.LlavaNextVideoVideoProcessor(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
        )
    processor = getattr(transformers, prefix + "Processor")(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
        **extra,
    )
    base = llava_config(tokenizer, vision=dict(TINY_VISION), text=dict(TINY_TEXT))
    if video:
        extra = {"video_token_id": tokenizer.convert_tokens_to_ids("<video>")}
    config = getattr(transformers, prefix + "Config")(
        vision_config=base.vision_config.to_dict(),
        text_config=base.text_config.to_dict(),
        image_token_id=base.image_token_id,
        image_grid_pinpoints=ANYRES_PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    model_cls = getattr(transformers, prefix + "ForConditionalGeneration")
    return _instantiate(model_cls, config, tokenizer, seed), processor


def tiny_llava_next_video(seed: int = 0):
    """A tiny random-weight LLaVA-NeXT-Video (see `tiny_llava_next`)."""
    return tiny_llava_next(seed, video=True)


@_with_tokenizer
def tiny_video_llava(seed: int = 0):
    """A tiny random-weight Video-LLaVA: CLIP image and video towers (224 px, 16 x 16 patches), shared projector."""
    from transformers import (
        VideoLlavaConfig,
        VideoLlavaForConditionalGeneration,
        VideoLlavaImageProcessor,
        VideoLlavaProcessor,
        VideoLlavaVideoProcessor,
    )

    tokenizer = tiny_tokenizer(("<image>", "<video>"), named={"image_token": "<image>", "video_token": "<video>"})
    size = {"shortest_edge": 224}, {"height": 224, "width": 224}
    processor = VideoLlavaProcessor(
        image_processor=VideoLlavaImageProcessor(size=size[0], crop_size=size[1]),
        video_processor=VideoLlavaVideoProcessor(size=size[0], crop_size=size[1]),
        tokenizer=tokenizer,
        patch_size=14,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    base = llava_config(tokenizer, vision=dict(TINY_VISION), text=dict(TINY_TEXT), image_size=224, patch_size=14)
    config = VideoLlavaConfig(
        vision_config=base.vision_config.to_dict(),
        text_config=base.text_config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
    )
    return _instantiate(VideoLlavaForConditionalGeneration, config, tokenizer, seed), processor


ONEVISION_PINPOINTS = [[384, 384], [384, 768], [768, 384], [768, 768], [384, 1152], [1152, 384], [1152, 1152],
                       [1536, 1536]]  # fmt: skip


@_with_tokenizer
def tiny_onevision(seed: int = 0, text_layers: int = 2):
    """A tiny random-weight LLaVA-OneVision: SigLIP (no [CLS], 27 x 27 tokens), anyres_max_9 packing with a 4 x 4
    pinpoint that triggers its downsampling, image newline, 2 x 2 bilinear video pooling; a Llama LLM of
    `text_layers` layers."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = tiny_tokenizer(("<image>", "<video>"), named={"image_token": "<image>", "video_token": "<video>"})
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": 384, "width": 384}, image_grid_pinpoints=ONEVISION_PINPOINTS
        ),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 384, "width": 384}),
        tokenizer=tokenizer,
        num_image_tokens=729,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_CHAT_TEMPLATE,
        vision_aspect_ratio="anyres_max_9",
    )
    text = llava_config(tokenizer, vision=dict(TINY_VISION), text=dict(TINY_TEXT, num_hidden_layers=text_layers))
    text = text.text_config
    vision = dict(TINY_VISION, model_type="siglip_vision_model", image_size=384, patch_size=14)
    vision.pop("projection_dim")
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        pad_token_id=tokenizer.pad_token_id,
    )
    return _instantiate(LlavaOnevisionForConditionalGeneration, config, tokenizer, seed), processor


def tiny_clip(model, processor, seed: int = 0, positions: int = 77, text: dict | None = None):
    """(CLIPModel, tokenizer): a random-weight CLIP whose vision width is `model`'s CLIP tower's (so that its
    `visual_projection` reads the tower's features, as CDPruner's relevance needs) and whose text tower reads
    `processor`'s tokenizer; `positions`: the text tower's length (longer questions are cut into rows of it);
    `text`: its widths (default tiny; CLIP-L's are hidden 768, 12 layers, 12 heads, projection 768). The CLIP's own
    vision tower has one layer: only its `visual_projection` is used."""
    from transformers import CLIPConfig, CLIPModel

    tokenizer = getattr(processor, "tokenizer", processor)
    vision = {**model.config.vision_config.to_dict(), "num_hidden_layers": 1}
    widths = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=16)
    widths.update(text or {})
    projection = widths.pop("projection_dim")
    text_config = dict(widths, vocab_size=len(tokenizer), max_position_embeddings=positions,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    config = CLIPConfig(text_config=text_config, vision_config=vision, projection_dim=projection)
    return CLIPModel(config).eval(), tokenizer
