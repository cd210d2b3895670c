"""Registration: the `vllm.general_plugins` entry point (`vtoken.serving.vllm:register`).

vLLM runs general plugins in every process (front end, engine core, workers); this registers, under vLLM's own
architecture names, subclasses of its model classes that act only when the config carries a `vtoken` entry, with
their processors (no architecture override for users), and a start-time check of the entry in the front end
(vLLM's per-architecture config hook), so a bad entry fails in the user's process, not as "Engine core
initialization failed". On every other architecture vLLM knows, the same hook refuses any `vtoken` entry (never
a silent run without pruning). Registering twice is harmless.
"""

from __future__ import annotations

from typing import Any

_done = False


def _front_end_check(base: Any, check) -> type:
    """A `VerifyAndUpdateConfig` class running `check(hf_config)` before the stock hook of the architecture."""
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    parent = base or VerifyAndUpdateConfig

    class VtokenCheck(parent):
        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            check(vllm_config.model_config.hf_config)
            super().verify_and_update_config(vllm_config)

    return VtokenCheck


def register() -> None:
    """Register vtoken's model subclasses and processors with vLLM (idempotent)."""
    global _done
    if _done:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from .families import FAMILIES, NOT_SERVED, refuser

    served = FAMILIES()
    for architecture, (model_cls, factories, check) in served.items():
        MULTIMODAL_REGISTRY.register_processor(factories["processor"], info=factories["info"],
                                               dummy_inputs=factories["dummy_inputs"])(model_cls)  # fmt: skip
        ModelRegistry.register_model(architecture, model_cls)
        MODELS_CONFIG_MAP[architecture] = _front_end_check(MODELS_CONFIG_MAP.get(architecture), check)
    # every other architecture vLLM knows (text-only ones too): an entry there is refused, never ignored
    for architecture in sorted({*ModelRegistry.get_supported_archs(), *NOT_SERVED} - served.keys()):
        MODELS_CONFIG_MAP[architecture] = _front_end_check(MODELS_CONFIG_MAP.get(architecture), refuser(architecture))
    _done = True
