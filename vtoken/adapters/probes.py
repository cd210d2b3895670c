"""Score probes: forward hooks that capture what a method needs from a layer that keeps running SDPA/flash."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from vtoken.kernels import attention_column_mean, attention_row_probs

from . import hf
from .compiled import eager


class ClsAttentionProbe:
    """[CLS]->patch post-softmax attention of one ViT self-attention layer, head-mean, patch keys only.

    Hooks the layer's q_proj and k_proj outputs (no extra matmul, no `output_attentions`) and computes only the
    [CLS] query row: O(S * d) per head instead of the S x S map. Use as a context manager around the tower call;
    `scores` is then [B, S - 1]. `projections`: the submodules whose outputs are the query and key the attention
    uses, e.g. ("q_norm", "k_norm") for towers that normalise q and k after projecting them (QK-norm). Only the
    thread that entered it is captured (another thread may run the same tower at the same time). `key_valid`: a
    callable giving the real keys [B, S] of a padded batch (a merge inside the tower), or None.
    """

    def __init__(
        self,
        attention: nn.Module,
        cls_index: int = 0,
        projections: tuple[str, str] = ("q_proj", "k_proj"),
        key_valid: Callable[[], torch.Tensor | None] | None = None,
    ):
        for name in projections:
            if not isinstance(getattr(attention, name, None), nn.Module):
                raise TypeError(f"{type(attention).__name__} has no {name}; cannot probe [CLS] attention")
        self.attention = attention
        self.projections = projections
        self.cls_index = cls_index
        self.key_valid = key_valid  # [B, S] real keys after a merge inside the tower (padded batches), read late
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self.scale = getattr(attention, "scale", self.head_dim**-0.5)
        self._query: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None
        self._hooks: list = []
        self._thread: int | None = None

    @eager
    def _on_query(self, module, args, output):
        if threading.get_ident() == self._thread:
            self._query = output[:, self.cls_index]

    @eager
    def _on_keys(self, module, args, output):
        if threading.get_ident() == self._thread:
            self._keys = output

    def __enter__(self) -> ClsAttentionProbe:
        self._thread = threading.get_ident()
        self._hooks = [
            getattr(self.attention, self.projections[0]).register_forward_hook(self._on_query),
            getattr(self.attention, self.projections[1]).register_forward_hook(self._on_keys),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def probs(self) -> torch.Tensor:
        """[B, H, S] attention of the [CLS] query over every key ([CLS] included)."""
        if self._query is None or self._keys is None:
            raise RuntimeError("the probed attention layer did not run")
        batch, seq = self._keys.shape[:2]
        query = self._query.reshape(batch, self.num_heads, self.head_dim)
        keys = self._keys.reshape(batch, seq, self.num_heads, self.head_dim)
        valid = self.key_valid() if self.key_valid is not None else None
        return attention_row_probs(query, keys, self.scale, valid)

    @property
    def patch_keys(self) -> torch.Tensor:
        """[B, S - 1, d] the patch tokens' keys, mean over heads (VisionZip's similarity metric)."""
        if self._keys is None:
            raise RuntimeError("the probed attention layer did not run")
        batch, seq = self._keys.shape[:2]
        keys = self._keys.reshape(batch, seq, self.num_heads, self.head_dim).mean(dim=2)
        return torch.cat([keys[:, : self.cls_index], keys[:, self.cls_index + 1 :]], dim=1)

    @property
    def scores(self) -> torch.Tensor:
        """[B, S - 1] head-mean attention to the patch keys (the [CLS] key removed, no renormalisation)."""
        probs = self.probs().mean(dim=1)
        return torch.cat([probs[:, : self.cls_index], probs[:, self.cls_index + 1 :]], dim=1)


class _Capture:
    """Forward hooks on submodules of one attention layer that keep what they see for the thread that entered."""

    def __init__(self) -> None:
        self._hooks: list = []
        self._thread: int | None = None

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _install(self) -> list:
        raise NotImplementedError

    def __enter__(self):
        self._thread = threading.get_ident()
        self._hooks = self._install()
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class ColumnAttentionProbe(_Capture):
    """How much attention each token of a ViT layer receives: post-softmax attention, mean over heads and over
    query rows (HoliTom's signal), from the layer's hooked q/k projections while the layer keeps SDPA/flash.
    `scores` is [B, S] after the tower ran (every token, [CLS] included where the tower has one)."""

    def __init__(self, attention: nn.Module, projections: tuple[str, str] = ("q_proj", "k_proj")):
        super().__init__()
        for name in projections:
            if not isinstance(getattr(attention, name, None), nn.Module):
                raise TypeError(f"{type(attention).__name__} has no {name}; cannot probe its attention")
        self.attention, self.projections = attention, projections
        self.num_heads, self.head_dim = attention.num_heads, attention.head_dim
        self.scale = getattr(attention, "scale", self.head_dim**-0.5)
        self._query: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None

    @eager
    def _on_query(self, module, args, output):
        if self._mine():
            self._query = output

    @eager
    def _on_keys(self, module, args, output):
        if self._mine():
            self._keys = output

    def _install(self) -> list:
        query, keys = (getattr(self.attention, name) for name in self.projections)
        return [query.register_forward_hook(self._on_query), keys.register_forward_hook(self._on_keys)]

    @property
    def scores(self) -> torch.Tensor:
        if self._query is None or self._keys is None:
            raise RuntimeError("the probed attention layer did not run")
        batch, seq = self._keys.shape[:2]
        shape = (batch, seq, self.num_heads, self.head_dim)
        return attention_column_mean(self._query.reshape(shape), self._keys.reshape(shape), self.scale)


class VisionQueryKeyProbe(_Capture):
    """A Qwen-VL vision block's queries and keys after rotary, [S, H, d] each (S: every patch of the call, in the
    encoder's internal order), read from the attention's fused `qkv` output and the rotary tables it is given."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        if not isinstance(getattr(attention, "qkv", None), nn.Module):
            raise TypeError(f"{type(attention).__name__} has no qkv projection; cannot probe its attention")
        self.attention = attention
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self._rotary = hf.vision_rotary(attention)
        self._qkv: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @eager
    def _on_call(self, module, args, kwargs):
        if self._mine():
            self._tables = kwargs.get("position_embeddings")

    @eager
    def _on_qkv(self, module, args, output):
        if self._mine():
            self._qkv = output

    def _install(self) -> list:
        return [self.attention.register_forward_pre_hook(self._on_call, with_kwargs=True),
                self.attention.qkv.register_forward_hook(self._on_qkv)]  # fmt: skip

    def query_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._qkv is None or self._tables is None:
            raise RuntimeError("the probed vision block did not run")
        query, keys, _ = self._qkv.reshape(self._qkv.shape[0], 3, self.num_heads, -1).unbind(1)
        cos, sin = self._tables
        return self._rotary(query, keys, cos, sin)
