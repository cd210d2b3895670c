"""Kernels, each beside a PyTorch reference with the same signature; dispatch picks Triton on CUDA."""

from .attention_rows import (
    attention_row_probs,
    attention_row_probs_reference,
    attention_row_probs_triton,
    causal_rows_probs,
    causal_rows_probs_reference,
    causal_rows_probs_triton,
)

__all__ = [
    "attention_row_probs",
    "attention_row_probs_reference",
    "attention_row_probs_triton",
    "causal_rows_probs",
    "causal_rows_probs_reference",
    "causal_rows_probs_triton",
]
