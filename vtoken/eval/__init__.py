"""lmms-eval integration: the model id `vtoken`, per-sample token records, an offline task pack, `vtoken eval`.

    pip install "vtoken[eval]"
    lmms-eval --model vtoken --model_args pretrained=vtoken-mini,method=fastervlm,budget=0.25 \
        --tasks vtoken_mini_vqa --include_path "$(python -m vtoken.eval --tasks-path)"

Importing this package does not import lmms-eval; `lmms_model` (the model class) and `sweep` do.
"""

from __future__ import annotations

from pathlib import Path

TASKS_PATH = Path(__file__).parent / "tasks"
MODEL_ID = "vtoken"


def tasks_path() -> Path:
    """The task pack's directory, for lmms-eval's `--include_path`."""
    return TASKS_PATH


def manifests():
    """The `lmms_eval.models` entry point: the model id `vtoken` -> `vtoken.eval.lmms_model.VTokenLMM` (chat)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=MODEL_ID, chat_class_path="vtoken.eval.lmms_model.VTokenLMM")]
