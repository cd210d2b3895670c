"""What the tiny builders share: the tokenizer-remembering decorator, seeded instantiation, the tiny LLM's widths
and Qwen's special tokens and chat template."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..question import remember_tokenizer


def _with_tokenizer(build: Callable) -> Callable:
    """A tiny-model builder whose model remembers its tokenizer (for methods that read the prompt's text)."""

    @functools.wraps(build)  # name, docstring and signature of the builder (the API docs read them)
    def built(*args, **kwargs):
        model, processor = build(*args, **kwargs)
        remember_tokenizer(model, processor)
        return model, processor

    return built


def _instantiate(model_cls: type, config, tokenizer, seed: int) -> torch.nn.Module:
    """`model_cls(config)` with random weights drawn from `seed`, in eval mode, padding with the tokenizer's pad."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _instantiate(model_cls: type, config, tokenizer, seed: int) -> torch.nn.Module:
    """`model_cls(config)` with random weights drawn from `seed`, in eval mode, padding with the tokenizer's pad."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, projection_dim=32)
TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def tiny_text(tokenizer, **overrides) -> dict:
    """The tiny LLM's config (as a dict): `TINY_TEXT` widths, `tokenizer`'s vocabulary and special ids, then
    `overrides` (model type, depth, rotary, ...)."""
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return {**TINY_TEXT, "vocab_size": len(tokenizer), "max_position_embeddings": 4096, **special, **overrides}


QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen-VL configs' special-token ids (image, video, vision start/end) from a tiny Qwen tokenizer."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
