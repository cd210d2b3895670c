"""Post-softmax attention of a few query rows to all keys, without materialising the full attention matrix.

Used for [CLS]-attention scores: the layer itself keeps running SDPA/flash; we recompute one row from its
q/k projections in O(S * d) per head.
"""

from __future__ import annotations

import torch


def attention_row_probs_reference(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention probabilities of one query per (batch, head) over all keys.

    query: [B, H, d]; keys: [B, S, H, d] (the layout k_proj outputs, reshaped); returns [B, H, S] float32.
    """
    logits = torch.einsum("bhd,bshd->bhs", query.float(), keys.float()) * scale
    return logits.softmax(dim=-1)


def attention_row_probs(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Dispatching entry point; same contract as `attention_row_probs_reference`."""
    return attention_row_probs_reference(query, keys, scale)
