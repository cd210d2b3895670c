"""Tiny random-weight InternVL and Gemma 3 models (offline, < 1 s), in `vtoken.zoo.TINY_MODELS`.

Real transformers classes and real processors (`GotOcr2ImageProcessor` tiling, `Gemma3ImageProcessor` with
pan-and-scan) at smaller image sizes, with configs whose token grids match them: InternVL tiles of 224 px with
7 px patches (32 x 32 patches -> 16 x 16 tokens after the pixel shuffle, as the real 448 / 14), Gemma 3 crops of
224 px with 7 px patches pooled 4 x 4 (8 x 8 tokens; the real model pools 64 x 64 patches to 16 x 16).
"""

from __future__ import annotations

import torch

from ..parts import tiny_tokenizer
from .common import _instantiate, _with_tokenizer, tiny_text

INTERNVL_SPECIALS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<IMG_CONTEXT>\n{% elif item['type'] == 'video' %}<video>\n"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@_with_tokenizer
def tiny_internvl(
    seed: int = 0, max_tiles: int = 6, qk_norm: bool = False, text_model: str = "qwen2", text_layers: int = 2
):
    """A tiny random-weight InternVL: InternViT with [CLS] (3 layers, QK-norm if `qk_norm`), tiles of 224 px up
    to `max_tiles` + a thumbnail, 0.5 pixel shuffle (256 tokens per tile), MLP projector, a `text_model` LLM
    ("qwen2", or "qwen3" with QK-norm) of `text_layers` layers."""
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}  # fmt: skip
    tokenizer = tiny_tokenizer(INTERNVL_SPECIALS, named=named)
    size = {"height": 224, "width": 224}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=max_tiles),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=tokenizer,
        image_seq_length=256,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=224,
                  patch_size=7, use_qk_norm=qk_norm)  # fmt: skip
    text = tiny_text(tokenizer, model_type=text_model, num_hidden_layers=text_layers)
    config = InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _instantiate(InternVLForConditionalGeneration, config, tokenizer, seed), processor


GEMMA3_SPECIALS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@_with_tokenizer
def tiny_gemma3(seed: int = 0):
    """A tiny random-weight Gemma 3: SigLIP (224 px, 7 px patches, no [CLS]), 4 x 4 average pool to 8 x 8 soft
    tokens per crop, pan-and-scan available (`do_pan_and_scan=True` at call time), a 2-layer Gemma 3 LLM with one
    sliding-window and one global layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = tiny_tokenizer(GEMMA3_SPECIALS, named=named)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 224, "width": 224}, pan_and_scan_min_crop_size=64),
        tokenizer=tokenizer,
        image_seq_length=64,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=224, patch_size=7)  # fmt: skip
    text = tiny_text(tokenizer, head_dim=16, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                     query_pre_attn_scalar=16)  # fmt: skip
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in named.items()}
    config = Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=64,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _instantiate(Gemma3ForConditionalGeneration, config, tokenizer, seed)
    # transformers initialises the projector's input projection to zeros: every image would be the same (zero)
    # soft tokens and no pruning could change the logits
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor
