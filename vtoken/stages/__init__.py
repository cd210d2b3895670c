"""The stages that act on visual tokens outside any one engine: every caller runs the same code.

`encoder.EncoderStage` is the encoder stage (a method's checks, its signals filled from one table, `select`,
placed selections, crop records, the checks of what a method returns) that the transformers adapters
(`vtoken.adapters`), the vLLM plugin (`vtoken.serving.vllm`) and `vtoken.select` all call. The stages that hook a
transformers language model (prefill drops, decode-time cuts, sparse attention) live with the adapters, in
`vtoken.adapters.llm` and `vtoken.adapters.sparse_prefill`: they are about transformers' decoder layers.
"""

from .encoder import COMMON_SIGNALS, EncoderStage, PlacedPicks, SignalSources

__all__ = ["COMMON_SIGNALS", "EncoderStage", "PlacedPicks", "SignalSources"]
