"""Tiny random-weight Qwen2-VL and Qwen2.5-VL models (dynamic-resolution ViT + 2 x 2 merger, M-RoPE Qwen2 LLM)."""

from __future__ import annotations

from ..parts import tiny_tokenizer
from .common import (
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    TINY_TEXT,
    _instantiate,
    _with_tokenizer,
    qwen_token_ids,
    tiny_text,
)


def _tiny_qwen(config_cls, model_cls, processor_cls, vision: dict, seed: int):
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = tiny_tokenizer(QWEN_SPECIALS, named={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 256),
        video_processor=Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    text = tiny_text(
        tokenizer, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    )
    config = config_cls(
        vision_config=vision,
        text_config=text,
        **qwen_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = _instantiate(model_cls, config, tokenizer, seed)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


@_with_tokenizer
def tiny_qwen2_vl(seed: int = 0):
    """A tiny random-weight Qwen2-VL: dynamic-resolution ViT + 2x2 patch merger, M-RoPE Qwen2 LM, image + video."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    vision = dict(depth=2, embed_dim=32, hidden_size=TINY_TEXT["hidden_size"], num_heads=4, mlp_ratio=2)
    return _tiny_qwen(Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, vision, seed)


@_with_tokenizer
def tiny_qwen2_5_vl(seed: int = 0):
    """A tiny random-weight Qwen2.5-VL: windowed-attention ViT (one full-attention block) + merger, M-RoPE LM."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=TINY_TEXT["hidden_size"],
        window_size=56,
        fullatt_block_indexes=[1],
    )
    return _tiny_qwen(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, vision, seed)
