"""vtoken's encoder-stage methods inside vLLM, as an out-of-tree plugin (see docs/serving.md).

    from vllm import LLM
    llm = LLM("llava-hf/llava-1.5-7b-hf", hf_overrides={"vtoken": {"method": "fastervlm", "budget": 0.25}})

Modules: `config` (the `vtoken` override parsed and checked), `families` + one module per model family (the
hooks), `signals` ([CLS] attention from vLLM's towers), `selection` (running a method), `question` (MMTok's
question through vLLM's caches), `registration` (the entry point), `checkpoints` (tiny test checkpoints).
Importing this package does not import vLLM; `register` does.
"""

from .config import OVERRIDE_KEY, ServingConfig, ServingConfigError, parse


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    from .registration import register as _register

    _register()


__all__ = ["register", "parse", "ServingConfig", "ServingConfigError", "OVERRIDE_KEY"]
