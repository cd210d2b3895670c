"""vtoken-mini: a LLaVA-1.5-architecture model (CLIP ViT with [CLS] + MLP projector + Llama) trained on the
procedural VQA of `vtoken.mini.vqa`, shipped inside the package and loaded offline with stock transformers classes.

192-px images, 16-px patches: 12 x 12 = 144 visual tokens from `vision_feature_layer=-2`, [CLS] dropped
("default" strategy), as llava-1.5 does, so [CLS]-attention methods read the same signal they read there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .vqa import IMAGE_SIZE, vocabulary

WEIGHTS = Path(__file__).parent / "weights"
PATCH_SIZE = 16
SPECIAL_TOKENS = ("<pad>", "<unk>", "<image>", "<s>", "</s>")  # </s> is not id 2: CLIP's text tower pools on it
VISION = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, projection_dim=128)
TEXT = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    initializer_range=0.06,  # 3x the default: attention starts content-dependent, not uniform (see train.py)
)


def build_tokenizer():
    """A word-level `PreTrainedTokenizerFast` over `vqa.vocabulary()` (whitespace/punctuation split, no BOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *vocabulary()])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={"image_token": "<image>"},
    )


def build_processor(tokenizer=None):
    """The real `LlavaProcessor` (CLIP image processor at 192 px, LLaVA chat template) around `tokenizer`."""
    from ..parts import llava_processor

    return llava_processor(tokenizer or build_tokenizer(), image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)


def build_config(tokenizer):
    """The `LlavaConfig` of vtoken-mini: CLIP tower (6 layers, [CLS]), 2-layer GELU projector, 4-layer Llama."""
    from ..parts import llava_config

    return llava_config(tokenizer, vision=dict(VISION), text=dict(TEXT), image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)


def build_model(tokenizer, seed: int = 0):
    """A freshly initialised vtoken-mini `LlavaForConditionalGeneration` (fp32, train mode)."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(build_config(tokenizer))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model


def pixel_values(images: list, processor=None) -> torch.Tensor:
    """[B, 3, 192, 192] normalised pixels of 192-px RGB images, without the processor's resize (training speed);
    equal to the processor's output on these images up to resampling round-off (tests check it)."""
    processor = processor or build_processor()
    mean = np.asarray(processor.image_processor.image_mean, dtype=np.float32)
    std = np.asarray(processor.image_processor.image_std, dtype=np.float32)
    batch = np.stack([np.asarray(image, dtype=np.float32) / 255.0 for image in images])
    return torch.from_numpy(((batch - mean) / std).transpose(0, 3, 1, 2).copy())


def load(weights: str | Path = WEIGHTS, dtype: torch.dtype | None = None):
    """(model, processor) of the shipped vtoken-mini, offline, in eval mode; the model remembers its tokenizer."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from ..question import remember_tokenizer

    model = LlavaForConditionalGeneration.from_pretrained(weights, dtype=dtype or torch.float32).eval()
    processor = AutoProcessor.from_pretrained(weights)
    remember_tokenizer(model, processor)
    return model, processor
