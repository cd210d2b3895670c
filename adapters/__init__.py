"""Model adapters, one file per family; importing this package registers them."""

from .base import Adapter, EncodedImages, Modality
from .llava import LlavaAdapter
from .llava_next import LlavaNextAdapter

__all__ = ["Adapter", "EncodedImages", "Modality", "LlavaAdapter", "LlavaNextAdapter"]
