"""Kernels, each beside a PyTorch reference with the same signature; dispatch picks Triton on CUDA."""

from .attention_rows import (
    attention_row_probs,
    attention_row_probs_reference,
    attention_row_probs_triton,
    causal_rows_probs,
    causal_rows_probs_reference,
    causal_rows_probs_triton,
)
from .block_sparse_attention import (
    block_mask_from_plan,
    block_sparse_attention,
    block_sparse_attention_reference,
    block_sparse_attention_triton,
)
from .greedy_picks import greedy_least_similar, greedy_least_similar_reference, greedy_least_similar_triton
from .visual_attention import visual_attention, visual_attention_reference, visual_attention_triton

__all__ = [
    "block_mask_from_plan",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "block_sparse_attention_triton",
    "attention_row_probs",
    "attention_row_probs_reference",
    "attention_row_probs_triton",
    "causal_rows_probs",
    "causal_rows_probs_reference",
    "causal_rows_probs_triton",
    "greedy_least_similar",
    "greedy_least_similar_reference",
    "greedy_least_similar_triton",
    "visual_attention",
    "visual_attention_reference",
    "visual_attention_triton",
]
