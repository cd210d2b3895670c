"""Score signals read from vLLM's vision towers, in the form vtoken's methods take (`VisualTokens.signals`).

vLLM's CLIP attention never materialises attention probabilities (it calls a fused kernel on q, k, v), so the
[CLS] row is computed from the layer's fused `qkv_proj` output: O(N * d) per head, as vtoken's transformers probe
does from `q_proj`/`k_proj`; the attention every token receives (HiPrune's and SCOPE's `received_attention`) by the
column-mean op from the same output. Under tensor parallelism each rank holds a slice of the heads: the head mean sums
every rank's heads (an all-reduce) before dividing by the total.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from vtoken.kernels import attention_column_mean, attention_row_probs


class QKVClsProbe:
    """[CLS]->patch head-mean post-softmax attention of one vLLM `CLIPAttention`, patch keys only ([B, S - 1]),
    and the patch keys' head mean ([B, S - 1, d], VisionZip's similarity metric).

    Use as a context manager around the tower call; `scores` / `patch_keys` afterwards. Only the entering thread
    is captured.
    """

    def __init__(self, attention: nn.Module):
        self.attention = attention
        self.local_heads = attention.num_heads_per_partition
        self.total_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self.scale = attention.scale
        self.tp_size = attention.tp_size
        self._qkv: torch.Tensor | None = None
        self._hook = None
        self._thread: int | None = None

    def _capture(self, module, args, output) -> None:
        if threading.get_ident() == self._thread:
            self._qkv = output[0] if isinstance(output, tuple) else output

    def __enter__(self) -> QKVClsProbe:
        self._thread = threading.get_ident()
        self._hook = self.attention.qkv_proj.register_forward_hook(self._capture)
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _query_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, H_local, d] queries and keys of this rank's heads."""
        if self._qkv is None:
            raise RuntimeError("vtoken: the probed vision attention layer did not run")
        query, keys, _ = self._qkv.chunk(3, dim=-1)  # [B, S, H_local * d] each
        batch, seq = keys.shape[:2]
        shape = (batch, seq, self.local_heads, self.head_dim)
        return query.reshape(shape), keys.reshape(shape)

    def _head_mean(self, summed: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's heads -> the mean over every rank's heads (tensor parallelism: all-reduced)."""
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            summed = tensor_model_parallel_all_reduce(summed)
        return summed / self.total_heads

    @property
    def scores(self) -> torch.Tensor:
        query, keys = self._query_keys()
        summed = attention_row_probs(query[:, 0].float(), keys.float(), self.scale).sum(dim=1)  # [B, S]
        return self._head_mean(summed)[:, 1:]

    @property
    def patch_keys(self) -> torch.Tensor:
        _, keys = self._query_keys()
        return self._head_mean(keys.sum(dim=2))[:, 1:]

    @property
    def received(self) -> torch.Tensor:
        """[B, S - 1] the attention every patch receives (`received_attention`): the post-softmax map's mean over
        every rank's heads and over every query row ([CLS] included), the [CLS] column dropped (the column-mean op,
        one launch: no [B, H, S, S] map)."""
        query, keys = self._query_keys()
        summed = attention_column_mean(query, keys, self.scale) * self.local_heads  # this rank's heads' sum
        return self._head_mean(summed)[:, 1:]
