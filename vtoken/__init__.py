"""vtoken: training-free visual-token pruning and merging for Hugging Face vision-language models.

import vtoken
handle = vtoken.patch(model, "fastervlm", budget=0.25)
model.generate(**processor(images=image, text=prompt, return_tensors="pt"))
print(handle.summary())
vtoken.unpatch(model)
"""

from . import adapters as _adapters  # noqa: F401  (registers the adapters)
from .api import PatchHandle, handle_of, patch, patched, unpatch
from .applicability import applicable_methods
from .budget import tokens_to_keep
from .errors import (
    AlreadyPatchedError,
    BudgetError,
    InputError,
    MissingSignalError,
    UnknownMethodError,
    UnsupportedModelError,
    VTokenError,
)
from .functional import encode, select
from .methods import (
    EncoderMethod,
    FasterVLM,
    FastV,
    FourierDCT,
    HiRED,
    Method,
    MMTok,
    MustDrop,
    Pool,
    PrefillMethod,
    Random,
    ScoreMethod,
    SparsePrefill,
)
from .question import remember_tokenizer
from .records import Record
from .registry import available_methods, make_method, supported_models
from .tokens import LayerTokens, Selection, TextQuery, VisualTokens

__version__ = "0.1.0"

__all__ = [
    "patch",
    "unpatch",
    "encode",
    "select",
    "patched",
    "handle_of",
    "PatchHandle",
    "available_methods",
    "applicable_methods",
    "make_method",
    "supported_models",
    "tokens_to_keep",
    "remember_tokenizer",
    "FasterVLM",
    "FastV",
    "FourierDCT",
    "HiRED",
    "MMTok",
    "MustDrop",
    "Random",
    "Pool",
    "SparsePrefill",
    "Method",
    "EncoderMethod",
    "PrefillMethod",
    "ScoreMethod",
    "Selection",
    "VisualTokens",
    "LayerTokens",
    "TextQuery",
    "Record",
    "VTokenError",
    "BudgetError",
    "UnknownMethodError",
    "UnsupportedModelError",
    "MissingSignalError",
    "AlreadyPatchedError",
    "InputError",
]
