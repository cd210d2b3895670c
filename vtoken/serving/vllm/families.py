"""The model families the plugin serves: architecture name -> (model class, processor factories, start check)."""

from __future__ import annotations

from typing import Any


def FAMILIES() -> dict[str, tuple[type, dict[str, Any], Any]]:  # noqa: N802 - a lazy constant
    from vllm.model_executor.models.llava import LlavaDummyInputsBuilder

    from . import llava, qwen

    return {
        **qwen.families(),
        "LlavaForConditionalGeneration": (
            llava.Llava,
            dict(llava.PROCESSOR, dummy_inputs=LlavaDummyInputsBuilder),
            llava.checked_config,
        ),
    }


# Architectures vtoken patches on transformers that the plugin does not serve yet: an entry is refused at start
# (never silently ignored), with the reason.
NOT_SERVED = {
    "LlavaNextForConditionalGeneration": "LLaVA-NeXT's native packing ends every row that keeps tokens with a "
    "newline, so its placeholder count is known only after selection",
    "LlavaNextVideoForConditionalGeneration": "as LLaVA-NeXT (newlines after rows that keep tokens)",
    "LlavaOnevisionForConditionalGeneration": "as LLaVA-NeXT (newlines after rows that keep tokens)",
    "Qwen2VLForConditionalGeneration": "not wired yet (Qwen2.5-VL and Qwen3-VL are)",
    "Gemma3ForConditionalGeneration": "not wired yet",
    "InternVLChatModel": "not wired yet",
}


def refuser(architecture: str):
    from .config import error, serving_config

    def refuse(hf_config) -> None:
        config = serving_config(hf_config)
        if config is not None:
            raise error(f"{architecture} is not served by vtoken's vLLM plugin: {NOT_SERVED[architecture]}; served: "
                        "LLaVA-1.5, Qwen2.5-VL, Qwen3-VL")  # fmt: skip

    return refuse
