"""Model adapters: the engine here (the patching core, `hf` for transformers' internals, probes, the LLM stages
in `llm/`) and one file per model family in `families/`; importing this package registers the families."""

from .base import Adapter, EncodedImages, Modality
from .families.fast_vlm import FastVlmAdapter
from .families.gemma3 import Gemma3Adapter
from .families.internvl import InternVLAdapter
from .families.llava import LlavaAdapter
from .families.llava_next import LlavaNextAdapter
from .families.llava_next_video import LlavaNextVideoAdapter
from .families.llava_onevision import LlavaOnevisionAdapter
from .families.perception_lm import PerceptionLMAdapter
from .families.qwen3_vl import Qwen3VLAdapter, Qwen35Adapter
from .families.qwen_vl import Qwen25VLAdapter, QwenVLAdapter
from .families.video_llava import VideoLlavaAdapter

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
