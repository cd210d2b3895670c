"""The attention a layer would compute without rotary and without a causal mask, maxed over heads (PruneVid's
signal, METHODS-4-video.md step 8), for a few query rows: read by the LLM stages from a layer's captured queries
and keys, while the layer itself runs SDPA/flash. A short fixed burst of PyTorch ops on any device: the rows are few
(the prompt's question), so the [B, H, R, S] logits are small and nothing is sequential."""

from __future__ import annotations

import torch


def plain_attention_max(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    visual: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Queries [B, R, H, d] and keys [B, S, Hkv, d] as the layer projects them *before rotary* (after its QK-norm),
    key_valid [B, S] (padding False), visual [B, V] the key slots of the row's visual tokens (-1: none). Returns
    [B, R, V] fp32: for each row, the largest over heads of softmax over every real key (no causal mask) of
    q . k * scaling, each head with its KV group (grouped-query attention: heads h * Hkv // H share key head
    h // (H // Hkv))."""
    heads, groups = queries.shape[2], keys.shape[2]
    keys = keys.float().repeat_interleave(heads // groups, dim=2)  # [B, S, H, d]
    logits = torch.einsum("brhd,bshd->bhrs", queries.float(), keys) * scaling
    logits = logits.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).amax(dim=1)  # [B, R, S]
    taken = probs.gather(2, visual.clamp(min=0)[:, None, :].expand(-1, probs.shape[1], -1))
    return taken.masked_fill((visual < 0)[:, None, :], 0.0)
