"""Model adapters, one file per family; importing this package registers them."""

from .base import Adapter, EncodedImages, Modality
from .fast_vlm import FastVlmAdapter
from .gemma3 import Gemma3Adapter
from .internvl import InternVLAdapter
from .llava import LlavaAdapter
from .llava_next import LlavaNextAdapter
from .llava_next_video import LlavaNextVideoAdapter
from .llava_onevision import LlavaOnevisionAdapter
from .perception_lm import PerceptionLMAdapter
from .qwen3_vl import Qwen3VLAdapter, Qwen35Adapter
from .qwen_vl import Qwen25VLAdapter, QwenVLAdapter
from .video_llava import VideoLlavaAdapter

__all__ = [
    "Adapter",
    "EncodedImages",
    "Modality",
    "Gemma3Adapter",
    "InternVLAdapter",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "LlavaNextVideoAdapter",
    "LlavaOnevisionAdapter",
    "QwenVLAdapter",
    "Qwen25VLAdapter",
    "Qwen3VLAdapter",
    "Qwen35Adapter",
    "VideoLlavaAdapter",
    "FastVlmAdapter",
    "PerceptionLMAdapter",
]
