"""ToMe inside vLLM's CLIP tower (LLaVA-1.5): every block vLLM builds (0..F, up to the feature layer) merges.

vLLM's `CLIPEncoder` calls each `CLIPEncoderLayer` on the hidden states and hands its output to the next, whatever
the sequence length, so merging inside a block shortens the sequence for the next one. For one tower call
(`MergingBlocks`, a context manager) every layer's forward is replaced on the *instance* (restored on exit) by
the block of METHODS-4-tower.md: h = x + Attn(LN1(x)), the method's merge of h (`ToMe.merge_block`, the same
code `vtoken.patch` runs), then h + MLP(LN2(h)). The attention is the layer's own (fused `qkv_proj`, its
`MMEncoderAttention`, `out_proj`); only with `prop_attn` after the first merge, whose log(size) bias no
`MMEncoderAttention` backend takes, the layer's q, k, v go through torch's SDPA with that bias instead (the
attention transformers' CLIP runs under `vtoken.patch`). The merge metric is the block's keys (from the fused
qkv), head mean; under tensor parallelism each rank holds some heads, so their sums are all-reduced first.

The count leaving the tower is N - sum r'_l, host integers (`ToMe.count_before_encoding`), so the processor sizes
the placeholders before the encoder runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own alias
from torch import nn

from vtoken.methods.base import TowerShape
from vtoken.methods.tome import MergeState, ToMe


def llava_shape(hf_config: Any, family: str, feature_block: int) -> TowerShape:
    """LLaVA's CLIP tower as ToMe reads it ([CLS] first; F = the block whose output is the feature layer)."""
    vision = hf_config.vision_config
    return TowerShape(family, cls=True, feature_block=feature_block, merge=1, patch=vision.patch_size, temporal=1,
                      channels=getattr(vision, "num_channels", 3))  # fmt: skip


def biased_attention(attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Attention of q, k, v [C, T, H_local * d] with an additive bias [C, 1, 1, T] on every head's logits (SDPA):
    [C, T, H_local * d]."""
    crops, tokens = q.shape[:2]
    heads = attention.num_heads_per_partition

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(crops, tokens, heads, -1).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=bias, scale=attention.scale)
    return out.transpose(1, 2).reshape(crops, tokens, -1)


class MergingBlocks:
    """While active, ToMe merges in the CLIP encoder `layers` (vLLM's, built up to the feature layer, so every
    one merges per the schedule). One tower call at a time (vLLM's model runner calls the encoder from one
    thread); `state` is that call's `MergeState` once block 0 ran."""

    def __init__(self, method: ToMe, layers: nn.ModuleList, shape: TowerShape) -> None:
        self.method, self.layers, self.shape = method, layers, shape
        self.state: MergeState | None = None

    def __enter__(self) -> MergingBlocks:
        for index, layer in enumerate(self.layers):
            layer.forward = _Block(self, index, layer).forward
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)

    def keys_metric(self, attention: nn.Module, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(keys, heads) for `ToMe.merge_block`: this block's keys [C, T, H * d] and H on one rank; under tensor
        parallelism the head mean over every rank's heads [C, T, d] (all-reduced sums), as one head."""
        local = attention.num_heads_per_partition
        if attention.tp_size == 1:
            return keys, local
        from vllm.distributed import tensor_model_parallel_all_reduce

        crops, tokens = keys.shape[:2]
        summed = tensor_model_parallel_all_reduce(keys.view(crops, tokens, local, -1).sum(dim=2))
        return summed / attention.num_heads, 1


class _Block:
    """One CLIP encoder layer's forward under ToMe (see the module)."""

    def __init__(self, owner: MergingBlocks, index: int, layer: nn.Module) -> None:
        self.owner, self.index, self.layer = owner, index, layer

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        owner, layer, method = self.owner, self.layer, self.owner.method
        if self.index == 0:  # a new tower call
            owner.state = method.start(hidden_states, owner.shape)
        state, attention = owner.state, layer.self_attn
        normed = layer.layer_norm1(hidden_states)
        qkv, _ = attention.qkv_proj(normed)
        q, k, v = qkv.chunk(3, dim=-1)  # [C, T, H_local * d] each
        bias = state.attention_bias(normed.dtype) if method.prop_attn else None
        attended = attention.attn(q, k, v) if bias is None else biased_attention(attention, q, k, v, bias)
        attended, _ = attention.out_proj(attended)
        h = hidden_states + attended
        keys, heads = k, attention.num_heads_per_partition
        if self.index < len(state.schedule) and state.schedule[self.index] > 0:  # a merging block: its metric
            keys, heads = owner.keys_metric(attention, k)
        h = method.merge_block(h, keys, heads, self.index, state)
        return h + layer.mlp(layer.layer_norm2(h))
