"""Model adapters, one file per family; importing this package registers them."""

from .base import Adapter, EncodedImages
from .llava import LlavaAdapter

__all__ = ["Adapter", "EncodedImages", "LlavaAdapter"]
