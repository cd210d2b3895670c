"""Tiny offline Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE models (the real transformers classes at tiny
widths; see `vtoken.zoo`).

Qwen3-VL: 16 px patches, 2 x 2 merger, learned position grid resampled per image, DeepStack (the outputs of ViT
blocks 0 and 1 added onto the visual positions after LLM layers 0 and 1), interleaved M-RoPE, a 4-layer Qwen3 LLM
with QK-norm. Qwen3.5: the same tower without DeepStack, a hybrid LLM (Gated DeltaNet linear attention and full
attention with a gated query, QK-norm and rotary on 25 % of each head). Video frames each get their own
placeholder run after a `<t seconds>` timestamp, as the real processor writes them.
"""

from __future__ import annotations

from ..parts import tiny_tokenizer
from ..question import remember_tokenizer
from .common import QWEN_CHAT_TEMPLATE, QWEN_SPECIALS, _instantiate, qwen_token_ids, tiny_text

QWEN3_VISION = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, num_position_embeddings=64
)  # out_hidden_size: the tiny LLM's width


def _qwen3_processor():
    """A real `Qwen3VLProcessor` (Qwen2-VL image processor at 16 px patches, Qwen3-VL video processor with
    timestamps), at most 256 merged tokens per image and 64 per frame pair."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokenizer = tiny_tokenizer(QWEN_SPECIALS, named={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    pixels = dict(min_pixels=64 * 64, max_pixels=32 * 32 * 256)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, **pixels),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 128}),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def _tiny_qwen3(config_cls, model_cls, vision: dict, text: dict, seed: int):
    processor = _qwen3_processor()
    tokenizer = processor.tokenizer
    text = tiny_text(tokenizer, **text)
    config = config_cls(
        vision_config=vision,
        text_config=text,
        **qwen_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _instantiate(model_cls, config, tokenizer, seed)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    remember_tokenizer(model, processor)  # for methods that read the prompt's text
    return model, processor


QWEN3_VL_TEXT = dict(
    num_hidden_layers=4,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                     "mrope_interleaved": True},
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_qwen3_vl(seed: int = 0):
    """A tiny random-weight Qwen3-VL: 16 px patches + 2 x 2 merger, DeepStack from ViT blocks 0 and 1 into LLM
    layers 0 and 1, a 4-layer Qwen3 LLM (QK-norm) with interleaved M-RoPE; images and timestamped video."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1])
    return _tiny_qwen3(Qwen3VLConfig, Qwen3VLForConditionalGeneration, vision, QWEN3_VL_TEXT, seed)


def tiny_qwen3_vl_moe(seed: int = 0):
    """A tiny random-weight Qwen3-VL-MoE: as `tiny_qwen3_vl` with a mixture-of-experts LLM (4 experts, top 2)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    vision = dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1])
    text = dict(QWEN3_VL_TEXT, **MOE, decoder_sparse_step=1)
    return _tiny_qwen3(Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, vision, text, seed)


QWEN3_5_TEXT = dict(
    num_hidden_layers=4,
    # the real models alternate 3 linear layers with 1 full one; at 4 layers, every 2nd is full so that a
    # full-attention layer (where LLM stages can drop) has later layers of both kinds
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)  # fmt: skip


def tiny_qwen3_5(seed: int = 0):
    """A tiny random-weight Qwen3.5: the Qwen3-VL tower without DeepStack, a hybrid 4-layer LLM (Gated DeltaNet
    linear attention and full attention with a gated query, QK-norm and partial rotary, alternating)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _tiny_qwen3(Qwen3_5Config, Qwen3_5ForConditionalGeneration, dict(QWEN3_VISION), QWEN3_5_TEXT, seed)


def tiny_qwen3_5_moe(seed: int = 0):
    """A tiny random-weight Qwen3.5-MoE: as `tiny_qwen3_5` with mixture-of-experts MLPs (4 experts, top 2, and a
    shared expert)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(QWEN3_5_TEXT, **MOE, shared_expert_intermediate_size=32)
    return _tiny_qwen3(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, dict(QWEN3_VISION), text, seed)
