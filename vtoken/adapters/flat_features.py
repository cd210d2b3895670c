"""For models whose forward scatters one tensor of visual features into the placeholders (InternVL, Gemma 3).

The adapters hand `generate` one [k_i, D] tensor per image (a list), since its beam / `num_return_sequences`
expansion splits a list by placeholder counts, whatever each image kept; stacking per crop would need equal
counts. Just before the model's own forward, a pre-hook on it concatenates the list into the one [sum k_i, D]
tensor the forward expects.
"""

from __future__ import annotations

from typing import Any

import torch

from . import hf


def _concatenate(module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    outputs = hf.encoder_outputs(kwargs)
    encoded = outputs.get("image")
    if encoded is None or not isinstance(encoded.pooler_output, list):
        return None
    outputs["image"] = hf.encoder_output(torch.cat(encoded.pooler_output))
    return args, {**kwargs, hf.ENCODER_OUTPUTS: outputs}


class FlatFeatures:
    """Adapter mixin (before `Adapter` in the bases): installs and removes the concatenating pre-hook."""

    def install(self) -> None:
        super().install()
        self._flat_hook = self.inner.register_forward_pre_hook(_concatenate, with_kwargs=True)

    def remove(self) -> None:
        hook = getattr(self, "_flat_hook", None)
        if hook is not None:
            hook.remove()
            self._flat_hook = None
        super().remove()
