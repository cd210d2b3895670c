"""Models by name: built-in tiny random-weight models (offline, < 1 s) or any checkpoint via `from_pretrained`.

Tiny models use the real `transformers` classes at tiny widths, a byte-level BPE tokenizer trained in-process by
`tokenizers` and the family's real image processor, so every code path is the one real checkpoints take. One
module per family group: `llava` (LLaVA-1.5/NeXT/NeXT-Video, Video-LLaVA, OneVision), `qwen2` (Qwen2/2.5-VL),
`qwen3` (Qwen3-VL, Qwen3.5), `timm_towers` (FastVLM, PerceptionLM), `internvl_gemma` (InternVL, Gemma 3).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import VTokenError
from ..hub import hub_kwargs
from ..parts import LLAVA_CHAT_TEMPLATE, llava_config, llava_processor, tiny_tokenizer
from ..prompts import build_prompt
from ..question import remember_tokenizer
from .common import QWEN_CHAT_TEMPLATE, QWEN_SPECIALS, TINY_TEXT, TINY_VISION, tiny_text
from .internvl_gemma import tiny_gemma3, tiny_internvl
from .llava import tiny_clip, tiny_llava, tiny_llava_next, tiny_llava_next_video, tiny_onevision, tiny_video_llava
from .qwen2 import tiny_qwen2_5_vl, tiny_qwen2_vl
from .qwen3 import tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_vl, tiny_qwen3_vl_moe
from .timm_towers import tiny_fastvlm, tiny_perception_lm

__all__ = [
    "TINY_MODELS", "BUILTIN_MODELS", "MINI", "load", "build_prompt",
    "tiny_llava", "tiny_llava_next", "tiny_llava_next_video", "tiny_video_llava", "tiny_onevision",
    "tiny_qwen2_vl", "tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5", "tiny_qwen3_5_moe",
    "tiny_fastvlm", "tiny_perception_lm", "tiny_internvl", "tiny_gemma3", "tiny_clip",
    "tiny_tokenizer", "tiny_text", "llava_processor", "llava_config",
    "LLAVA_CHAT_TEMPLATE", "QWEN_CHAT_TEMPLATE", "QWEN_SPECIALS", "TINY_TEXT", "TINY_VISION",
]  # fmt: skip

TINY_MODELS: dict[str, Callable] = {
    "tiny-onevision": tiny_onevision,
    "tiny-video-llava": tiny_video_llava,
    "tiny-llava-next-video": tiny_llava_next_video,
    "tiny-llava": tiny_llava,
    "tiny-llava-next": tiny_llava_next,
    "tiny-qwen2-vl": tiny_qwen2_vl,
    "tiny-qwen2.5-vl": tiny_qwen2_5_vl,
    "tiny-fastvlm": tiny_fastvlm,
    "tiny-perception-lm": tiny_perception_lm,
    "tiny-internvl": tiny_internvl,
    "tiny-gemma3": tiny_gemma3,
    "tiny-qwen3-vl": tiny_qwen3_vl,
    "tiny-qwen3-vl-moe": tiny_qwen3_vl_moe,
    "tiny-qwen3.5": tiny_qwen3_5,
    "tiny-qwen3.5-moe": tiny_qwen3_5_moe,
}


MINI = "vtoken-mini"  # the trained model shipped in the package (vtoken/mini/weights)
BUILTIN_MODELS = (MINI, *TINY_MODELS)


def load(name_or_path: str, dtype: torch.dtype | str | None = None, device: str | None = None, **kwargs):
    """(model, processor) for a built-in name (vtoken-mini or a tiny one), a local checkpoint directory or a hub id.

    Checkpoints load through `AutoModelForImageTextToText` / `AutoProcessor`, the path users take.
    """
    if name_or_path == MINI:
        from ..mini.model import load as load_mini

        model, processor = load_mini()
    elif name_or_path in TINY_MODELS:
        model, processor = TINY_MODELS[name_or_path]()
    else:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        local = Path(name_or_path).exists()
        if not local and "/" not in name_or_path:
            raise VTokenError(
                f"model {name_or_path!r} is neither a built-in model ({MINI}, or tiny-* such as tiny-llava: "
                "`vtoken list` names all), a local checkpoint directory nor a hub id (owner/name)"
            )
        hub = {} if local else hub_kwargs(name_or_path)  # an unreachable hub fails here in seconds, not a minute
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype or "auto", **hub, **kwargs).eval()
        processor = AutoProcessor.from_pretrained(name_or_path, **hub)
        remember_tokenizer(model, processor)
    if dtype is not None and name_or_path in BUILTIN_MODELS:
        model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if device is not None:
        model = model.to(device)
    return model, processor
