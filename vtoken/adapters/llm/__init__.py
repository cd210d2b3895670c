"""The LLM-side stages: dropping visual tokens between decoder layers (prefill), cutting per-layer KV caches and
selecting what each decoding step reads (decode), on one model instance through hooks.

One job per module: `views` (what a group of layers runs on, and the index arithmetic of a drop), `probe` (a
layer's queries and keys, read while it runs SDPA/flash), `reads` (what a method reads at a drop point),
`prefill` (the drop engine), `decode` (the KV cut and each decoding step's masks and positions), `selection` (a
decode-time selection: DyCoke), `records` (records built when read) and `stages` (the hooks that tie them).
"""

from .probe import QueryKeyProbe
from .selection import DecodeSelection
from .stages import LanguageModelStages
from .views import LayerView

__all__ = ["DecodeSelection", "LanguageModelStages", "LayerView", "QueryKeyProbe"]
