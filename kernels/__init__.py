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
from .dpp import dpp_greedy, dpp_greedy_reference, dpp_greedy_triton

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
    "dpp_greedy",
    "dpp_greedy_reference",
    "dpp_greedy_triton",
]
