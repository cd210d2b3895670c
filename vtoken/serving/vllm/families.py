"""The model families the plugin serves: architecture name -> (model class, processor factories, start check)."""

from __future__ import annotations

from typing import Any


def FAMILIES() -> dict[str, tuple[type, dict[str, Any], Any]]:  # noqa: N802 - a lazy constant
    from vllm.model_executor.models.llava import LlavaDummyInputsBuilder

    from . import llava

    return {
        "LlavaForConditionalGeneration": (
            llava.Llava,
            dict(llava.PROCESSOR, dummy_inputs=LlavaDummyInputsBuilder),
            llava.checked_config,
        ),
    }
