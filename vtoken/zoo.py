"""Models by name: built-in tiny random-weight models (offline, < 1 s) or any checkpoint via `from_pretrained`.

Tiny models use the real `transformers` classes at tiny widths, a byte-level BPE tokenizer trained in-process by
`tokenizers` and the family's real image processor, so every code path is the one real checkpoints take.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .errors import VTokenError
from .question import remember_tokenizer

_CORPUS = (
    "USER: ASSISTANT: what is in the image? describe the image in detail. what colour is the object? "
    "how many shapes are there? is there a red circle at the top left? answer the question using a single word "
    "or phrase. the image shows a cat sitting on a mat next to a cup of coffee. an astronaut in a white suit "
    "stands in front of a flag. a rocket on a launch pad. red green blue yellow circle square triangle star one "
    "two three four five yes no left right top bottom centre small large"
)


def _with_tokenizer(build: Callable) -> Callable:
    """A tiny-model builder whose model remembers its tokenizer (for methods that read the prompt's text)."""

    def built(*args, **kwargs):
        model, processor = build(*args, **kwargs)
        remember_tokenizer(model, processor)
        return model, processor

    built.__name__, built.__doc__ = build.__name__, build.__doc__
    return built


def _instantiate(model_cls: type, config, tokenizer, seed: int) -> torch.nn.Module:
    """`model_cls(config)` with random weights drawn from `seed`, in eval mode, padding with the tokenizer's pad."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: {% for item in message['content'] %}{{ item['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def tiny_tokenizer(
    special_tokens: tuple[str, ...] = ("<image>",), vocab_size: int = 384, named: dict[str, str] | None = None
):
    """A byte-level BPE tokenizer trained in-process on a fixed corpus (deterministic, ~ms).

    named: the processor-facing names of special tokens (default {"image_token": "<image>"}).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = ("<pad>", "<s>", "</s>")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*base, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        extra_special_tokens=named or {"image_token": "<image>"},
    )


def llava_processor(tokenizer=None, image_size: int = 336, patch_size: int = 14):
    """A real `LlavaProcessor` (CLIP image processor + chat template) around `tokenizer` (default: the tiny BPE)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer or tiny_tokenizer(),
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def llava_config(tokenizer, vision: dict, text: dict, image_size: int = 336, patch_size: int = 14):
    """A `LlavaConfig` (CLIP tower with [CLS] + Llama) whose special ids come from `tokenizer`."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    return LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=image_size, patch_size=patch_size, **vision),
        text_config=LlamaConfig(
            vocab_size=text.pop("vocab_size", len(tokenizer)),
            max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **text,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
    )


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


QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = tiny_text(
        tokenizer, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    )
    config = config_cls(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
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
def tiny_onevision(seed: int = 0):
    """A tiny random-weight LLaVA-OneVision: SigLIP (no [CLS], 27 x 27 tokens), anyres_max_9 packing with a 4 x 4
    pinpoint that triggers its downsampling, image newline, 2 x 2 bilinear video pooling."""
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
    text = llava_config(tokenizer, vision=dict(TINY_VISION), text=dict(TINY_TEXT)).text_config
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


def tiny_fastvlm(seed: int = 0):
    """A tiny random-weight FastVLM (timm FastViTHD tower; see `vtoken.zoo_timm`, which needs timm)."""
    from .zoo_timm import tiny_fastvlm as build

    return build(seed)


def tiny_perception_lm(seed: int = 0):
    """A tiny random-weight PerceptionLM (timm PE tower, tiles, video; see `vtoken.zoo_timm`, which needs timm)."""
    from .zoo_timm import tiny_perception_lm as build

    return build(seed)


from .zoo_internvl_gemma import TINY_MODELS as _INTERNVL_GEMMA  # noqa: E402  (its builders use the helpers above)

# Qwen3-VL / Qwen3.5 builders live in their own module (they reuse the helpers above)
from .zoo_qwen3 import tiny_qwen3_5, tiny_qwen3_5_moe, tiny_qwen3_vl, tiny_qwen3_vl_moe  # noqa: E402

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
    **_INTERNVL_GEMMA,  # tiny-internvl, tiny-gemma3
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
        from .mini.model import load as load_mini

        model, processor = load_mini()
    elif name_or_path in TINY_MODELS:
        model, processor = TINY_MODELS[name_or_path]()
    else:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if not Path(name_or_path).exists() and "/" not in name_or_path:
            raise VTokenError(
                f"model {name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
                "a local checkpoint directory nor a hub id (owner/name)"
            )
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype or "auto", **kwargs).eval()
        processor = AutoProcessor.from_pretrained(name_or_path)
        remember_tokenizer(model, processor)
    if dtype is not None and name_or_path in BUILTIN_MODELS:
        model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if device is not None:
        model = model.to(device)
    return model, processor


def build_prompt(processor, question: str, num_images: int = 1, num_videos: int = 0) -> str:
    """The model's own chat-formatted prompt for one user turn with images, videos and `question`."""
    content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)
