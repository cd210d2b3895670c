"""Tiny random-weight checkpoints that both vLLM and transformers load, saved from vtoken's zoo (tests, benchmarks).

Two things differ from the zoo's in-memory models, both for vLLM:
- LLM head size 32: vLLM's CPU attention takes head sizes {32, 64, 80, ...} only (the zoo's LLMs use 16), so the
  heads are halved (or, where the config sets `head_dim`, widened) and M-RoPE sections scaled to match;
- the CLIP tower's weights are saved under `vision_tower.vision_model.*` (transformers 5 saves its flat CLIP as
  `vision_tower.embeddings.*`, vLLM's loader expects the nested name that released LLaVA checkpoints carry and
  transformers still reads).
Needs transformers >= the zoo's; run it in the environment that has vtoken's dev dependencies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

FAMILIES = ("llava", "llava-next", "qwen2.5-vl", "qwen3-vl", "llama")  # llama: text only (a refusal's test)


def _llava_text(config) -> None:
    text = config.text_config
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 2, 2, 32


def _qwen25_text(config) -> None:
    text = config.text_config
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 2, 2, 32
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 6, 6]}


def _qwen3_text(config) -> None:
    text = config.text_config
    text.head_dim = 32
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 6, 6]}


def _builders() -> dict[str, tuple[Callable, Callable]]:
    from vtoken import zoo

    return {
        "llava": (zoo.tiny_llava, _llava_text),
        "llava-next": (zoo.tiny_llava_next, _llava_text),
        "qwen2.5-vl": (zoo.tiny_qwen2_5_vl, _qwen25_text),
        "qwen3-vl": (zoo.tiny_qwen3_vl, _qwen3_text),
    }


def tiny_model(family: str, seed: int = 0, **build):
    """(model, processor): the zoo's tiny `family` with the LLM head size vLLM accepts, weights drawn from `seed`
    (`build`: keywords of the zoo builder, e.g. LLaVA's image_size)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if family == "llama":
        return _tiny_llama(seed)
    builder, adjust = _builders()[family]
    model, processor = builder(seed, **build)
    config = model.config
    adjust(config)
    torch.manual_seed(seed)
    model = type(model)(config).eval()
    if family.startswith("qwen"):  # generation ids as the zoo sets them
        model.generation_config.bos_token_id = processor.tokenizer.bos_token_id
        model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor


def _tiny_llama(seed: int):
    """(LlamaForCausalLM, tokenizer): the tiny LLaVA's LLM alone, an architecture the plugin does not serve."""
    from transformers import LlamaForCausalLM

    llava, processor = tiny_model("llava", seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llava.config.text_config).eval()
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor.tokenizer


def save_tiny(family: str, path: str | Path, seed: int = 0, query_scale: float = 1.0, **build) -> Path:
    """Save the tiny `family` checkpoint (weights, config, tokenizer, processor) to `path`; returns it.

    `query_scale` (LLaVA families) multiplies the queries of the CLIP layer whose [CLS] attention methods score
    (the feature layer): a peaked attention whose scores do not nearly tie. The random tower's [CLS] attention is
    nearly flat (neighbouring scores 1e-7 apart), so a method that uses the whole score order (VisPruner's
    duplicate removal splits the ranked tokens by parity) picks differently on two engines that round differently.
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model, processor = tiny_model(family, seed, **build)
    if query_scale != 1.0:
        if not family.startswith("llava"):
            raise ValueError(f"query_scale is for the LLaVA families' CLIP tower, not {family!r}")
        layers = model.model.vision_tower.encoder.layers
        layer = model.config.vision_feature_layer % (len(layers) + 1) - 1
        with torch.no_grad():
            layers[layer].self_attn.q_proj.weight.mul_(query_scale)
            layers[layer].self_attn.q_proj.bias.mul_(query_scale)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    if family.startswith("llava"):
        weights = path / "model.safetensors"
        state = load_file(weights)
        renamed = {_nested_clip(k): v for k, v in state.items()}
        save_file(renamed, weights, metadata={"format": "pt"})
    return path


def _nested_clip(key: str) -> str:
    """`[model.]vision_tower.X` -> `[model.]vision_tower.vision_model.X` (keys already nested are kept)."""
    head, found, tail = key.partition("vision_tower.")
    if not found or tail.startswith("vision_model."):
        return key
    return f"{head}vision_tower.vision_model.{tail}"
