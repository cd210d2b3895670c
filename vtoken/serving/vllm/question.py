"""The question text-guided methods (MMTok) read, carried from vLLM's front end to its encoder.

vLLM encodes an image once per content hash and reuses the result for every request with that image (encoder
cache, processor cache, prefix cache). A selection that depends on the question must not be reused for another
question, so the question is made a processor keyword: vLLM mixes processor keywords into every item's hash.
It then travels to the model as a per-image field of UTF-8 bytes (`vtoken_question`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import BatchFeature

from vtoken.question import question_from_prompt

from .config import serving_config

FIELD = "vtoken_question"


def wants_question(hf_config: Any) -> bool:
    config = serving_config(hf_config)
    return config is not None and "question" in config.method.requires


def prompt_question(tokenizer: Any, prompt_ids: list[int], given: str | None) -> str:
    """The method's own `question=` if set, else the last user turn of the prompt (as `vtoken.patch` reads it)."""
    if given is not None:
        return given
    special = tuple(getattr(tokenizer, "all_special_tokens", ()))
    return question_from_prompt(tokenizer.decode(prompt_ids, skip_special_tokens=False), special)


def encode(question: str, items: int) -> torch.Tensor:
    """[items, L] uint8: the question's UTF-8 bytes, one row per image."""
    data = torch.tensor(list(question.encode("utf-8")), dtype=torch.uint8)
    return data.expand(items, -1).clone()


def decode(field: Any) -> list[str]:
    """The questions of a batch of images from the field vLLM hands the model (a tensor or a list of rows)."""
    rows = list(field) if not isinstance(field, torch.Tensor) or field.dim() == 2 else [field]
    return [bytes(row.to(torch.uint8).tolist()).decode("utf-8") for row in rows]


class QuestionProcessorMixin:
    """Mixed into a vLLM `BaseMultiModalProcessor` subclass: adds the question to the processor keywords (so to
    every item hash) and to the outputs, for methods that require "question"."""

    def apply(self, inputs, timing_ctx):
        hf_config = self.info.get_hf_config()
        if wants_question(hf_config) and inputs.mm_data_items:
            method = serving_config(hf_config).method
            question = prompt_question(self.info.get_tokenizer(), inputs.prompt, method.question)
            inputs = replace(inputs, hf_processor_mm_kwargs={**inputs.hf_processor_mm_kwargs, FIELD: question})
        return super().apply(inputs, timing_ctx)

    def _call_hf_processor(self, hf_data, hf_kwargs) -> BatchFeature:
        question = hf_kwargs.get(FIELD)
        outputs = super()._call_hf_processor(hf_data, without_question(hf_kwargs))
        if question is not None:
            images = len(hf_data.get("images") or ())
            outputs[FIELD] = encode(question, images)
        return outputs

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        from vllm.multimodal.inputs import MultiModalFieldConfig

        fields = dict(super()._get_mm_fields_config(hf_inputs, without_question(hf_processor_mm_kwargs)))
        if FIELD in hf_inputs:
            fields[FIELD] = MultiModalFieldConfig.batched("image")
        return fields


def without_question(kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(kwargs).items() if k != FIELD}
