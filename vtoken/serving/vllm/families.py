"""The model families the plugin serves: architecture name -> (model class, processor factories, start check), and
the refusal of a `vtoken` entry on every other architecture."""

from __future__ import annotations

from typing import Any

# The architectures served, with the family names the docs use (FAMILIES builds their hooks).
SERVED = {
    "LlavaForConditionalGeneration": "LLaVA-1.5",
    "LlavaNextForConditionalGeneration": "LLaVA-NeXT",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL",
}


def FAMILIES() -> dict[str, tuple[type, dict[str, Any], Any]]:  # noqa: N802 - a lazy constant
    from vllm.model_executor.models.llava import LlavaDummyInputsBuilder

    from . import llava, llava_next, qwen

    return {
        **qwen.families(),
        "LlavaForConditionalGeneration": (
            llava.Llava,
            dict(llava.PROCESSOR, dummy_inputs=LlavaDummyInputsBuilder),
            llava.checked_config,
        ),
        "LlavaNextForConditionalGeneration": (
            llava_next.LlavaNext,
            dict(llava_next.PROCESSOR, dummy_inputs=LlavaDummyInputsBuilder),
            llava_next.checked_config,
        ),
    }


# Architectures vtoken patches on transformers that the plugin does not serve yet, with the reason; every other
# architecture vLLM knows is refused too (generic reason). An entry is refused at start, never silently ignored.
NOT_SERVED = {
    "LlavaNextVideoForConditionalGeneration": "not wired yet (its native image packing ends every row that keeps "
    "tokens with a newline, so a crop-level selection's count is known only after selection)",
    "LlavaOnevisionForConditionalGeneration": "not wired yet (its native packing ends every row that keeps tokens "
    "with a newline, so a crop-level selection's count is known only after selection)",
    "Qwen2VLForConditionalGeneration": "not wired yet (Qwen2.5-VL and Qwen3-VL are)",
    "Gemma3ForConditionalGeneration": "not wired yet",
    "InternVLChatModel": "not wired yet",
}
OTHER = "the plugin has no hooks for this architecture (its placeholders, vision tower and positions)"


def served_list() -> str:
    return ", ".join(f"{arch} ({name})" for arch, name in SERVED.items())


def refuser(architecture: str):
    """A start-time check of `hf_config` that refuses any `vtoken` entry on `architecture` (not served)."""
    from .config import error, serving_config

    def refuse(hf_config) -> None:
        if serving_config(hf_config) is not None:
            why = NOT_SERVED.get(architecture, OTHER)
            raise error(
                f"architecture {architecture} is not served by vtoken's vLLM plugin: {why}. Served architectures: "
                f"{served_list()}; remove the 'vtoken' entry to run {architecture} unpruned"
            )

    return refuse
