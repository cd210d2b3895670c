"""The probe that reads a decoder layer's queries and keys while the layer itself runs SDPA/flash, and computes the
attention statistics a drop or a decoding step needs from them (the fused `vtoken::visual_attention` op)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from vtoken.errors import VTokenError
from vtoken.kernels import causal_rows_probs, rotary_visual_attention, visual_attention
from vtoken.kernels.plain_attention import plain_attention_max
from vtoken.kernels.visual_attention import rotate_half_reference

from .. import hf
from ..compiled import eager
from ..state import PerThread


class QueryKeyProbe:
    """Captures one attention layer's queries and keys (as its attention sees them before rotary) and its rotary
    tables, to compute chosen rows afterwards while the layer itself runs SDPA/flash.

    Queries and keys are read where the layer finishes them: at the outputs of `q_norm`/`k_norm` where the layer
    has those modules (QK-norm: Qwen3, Qwen3-VL, Qwen3.5, Gemma 3, OLMo 2; an `Identity` where it is off), else at
    `q_proj`/`k_proj`, or split from a fused `qkv_proj` (Phi-3). A gated `q_proj` (Qwen3.5: query and gate
    interleaved per head, 2 x head_dim each) is de-gated; its `q_norm` already sees the query half. Rotary comes
    from the modelling module's own `apply_rotary_pos_emb`, so partial rotary (Qwen3.5, Phi-3) is the model's own.
    """

    def __init__(self, attention: nn.Module, capture: bool = True):
        self.check(attention)  # before any hook: a refused probe leaves nothing behind
        self.attention = attention
        self._rotary = _rotary_function(attention)
        self.head_dim = int(attention.head_dim)
        self._rotate_half = _rotate_half_form(self._rotary, self.head_dim)  # the fused op can apply it
        self.heads = _heads(attention)
        self._captures = PerThread(_Captures)  # per thread: hooks run in the calling thread
        fused = _module(attention, "q_proj") is None  # fused: [B, S, (H + 2 Hkv) * d], queries first, then keys
        self._fused = (self.heads * self.head_dim, _kv_heads(attention) * self.head_dim) if fused else None
        hooks = []
        if capture:  # else only `replay` fills the store (the layer is scored before it runs)
            hooks.append(attention.register_forward_pre_hook(self._on_input, with_kwargs=True))
            if fused:
                hooks.append(attention.qkv_proj.register_forward_hook(self._on_fused))
            for name in ("q", "k"):
                source = _module(attention, f"{name}_norm") or _module(attention, f"{name}_proj")
                if source is not None:  # bound methods and partials, never closures: a patched model pickles
                    hooks.append(source.register_forward_hook(functools.partial(self._on_output, name)))
        self._hooks = hooks
        proj = _module(attention, "q_proj")
        # a gated q_proj: query and gate interleaved per head (Qwen3.5)
        self._gated_proj = proj is not None and getattr(proj, "out_features", 0) == 2 * self.heads * self.head_dim
        self._gated = _module(attention, "q_norm") is None and self._gated_proj  # what the capture hook sees

    @staticmethod
    def missing(attention: nn.Module) -> list[str]:
        """What `attention` lacks for the probe (empty if nothing)."""
        missing = []
        projections = _module(attention, "q_proj") is not None and _module(attention, "k_proj") is not None
        if not projections and _module(attention, "qkv_proj") is None:
            missing.append("q_proj and k_proj modules (or a fused qkv_proj)")
        if not isinstance(getattr(attention, "head_dim", None), int):
            missing.append("an integer `head_dim`")
        if not isinstance(getattr(attention, "scaling", None), float):
            missing.append("a float `scaling`")
        try:
            _heads(attention)
            if _module(attention, "q_proj") is None:
                _kv_heads(attention)
        except AttributeError:
            missing.append("its head counts (`config.num_attention_heads` / `num_key_value_heads`)")
        if _rotary_function(attention) is None:
            missing.append(f"an `apply_rotary_pos_emb` in its module {type(attention).__module__}")
        return missing

    @classmethod
    def check(cls, attention: nn.Module | None, where: str = "") -> None:
        """Raise a VTokenError naming the attention class and what it lacks, if the probe cannot read it."""
        if attention is None:
            raise VTokenError(f"{where or 'this layer'} has no `self_attn` (softmax attention) to score tokens with")
        missing = cls.missing(attention)
        if missing:
            raise VTokenError(
                f"cannot read attention rows from {type(attention).__name__}{' (' + where + ')' if where else ''}: "
                f"it needs {'; '.join(missing)}"
            )

    @property
    def active(self) -> bool:
        return self._captures.get().active

    @active.setter
    def active(self, value: bool) -> None:
        self._captures.get().active = value

    @property
    def _store(self) -> dict[str, Any]:
        return self._captures.get().store

    @eager
    def _on_output(self, name: str, module, args, output) -> None:
        self._keep(name, output)

    @eager
    def _on_fused(self, module, args, output) -> None:
        """A fused qkv_proj's output [B, S, (H + 2 Hkv) * d]: queries first, then keys."""
        queries, keys = self._fused
        self._keep("q", output[..., :queries])
        self._keep("k", output[..., queries : queries + keys])

    def _keep(self, name: str, value: Any) -> None:
        if self.active:
            self._store[name] = value

    @eager
    def _on_input(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self._keep("length", None if hidden is None else hidden.shape[1])
        self._keep("rotary", kwargs.get("position_embeddings"))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def clear(self) -> None:
        """Forget what this thread captured (so a layer's queries and keys are not held past their use)."""
        self._store.clear()

    def _per_head(self, x: torch.Tensor, seq: int, gated: bool = False) -> torch.Tensor:
        """x as [B, S, heads, d], from [B, S, heads * d] (or [B, S, heads * 2d] gated), [B, S, heads, d] or
        [B, heads, S, d] (QK-norm after the transpose, as Gemma 3 does)."""
        if x.dim() == 3:
            x = x.view(x.shape[0], seq, -1, (2 if gated else 1) * self.head_dim)
            return x[..., : self.head_dim] if gated else x
        sequence_first = x.shape[1] == seq
        if x.shape[1] == seq and x.shape[2] == seq:  # heads == seq: the sequence axis is the outer one in memory
            sequence_first = x.stride(1) >= x.stride(2)
        return x if sequence_first else x.transpose(1, 2)

    def replay(self, hidden: torch.Tensor, rotary: Any) -> None:
        """Compute the queries and keys this attention would compute from its (normed) input `hidden` [B, S, D],
        with rotary tables `rotary`, into the store, as its forward would (for `attention_rows` / `keys`)."""
        attention, (batch, seq) = self.attention, hidden.shape[:2]
        if self._fused is not None:
            queries, keys = self._fused
            fused = attention.qkv_proj(hidden)
            q, k = fused[..., :queries], fused[..., queries : queries + keys]
        else:
            q, k = attention.q_proj(hidden), attention.k_proj(hidden)
        q = q.view(batch, seq, -1, (2 if self._gated_proj else 1) * self.head_dim)[..., : self.head_dim]
        k = k.view(batch, seq, -1, self.head_dim)
        norms = _module(attention, "q_norm"), _module(attention, "k_norm")
        q, k = (x if norm is None else norm(x) for x, norm in zip((q, k), norms, strict=True))
        self._store.update(q=q, k=k, rotary=rotary, length=seq)

    def _take(self, key_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The stored queries [B, S, H, d] and keys [B, S, Hkv, d] (before rotary) and rotary tables, removed."""
        store = self._store
        q, k, rotary = store.pop("q"), store.pop("k"), store.pop("rotary", None)
        seq = store.pop("length", None) or key_valid.shape[1]
        return self._per_head(q, seq, self._gated), self._per_head(k, seq), rotary  # replayed: already per head

    def _rotated_keys(self, k: torch.Tensor, rotary: Any) -> torch.Tensor:
        """[B, S, Hkv, d] keys -> [B, Hkv, S, d] with rotary applied."""
        k = k.transpose(1, 2)
        if rotary is None:
            return k
        cos, sin = (t.expand(k.shape[0], *t.shape[1:]) for t in rotary)
        return self._rotary(k, k, cos, sin)[1]

    def _row_queries(self, q: torch.Tensor, rotary: Any, rows: torch.Tensor) -> torch.Tensor:
        """[B, H, R, d] the queries of sequence rows `rows` [B, R] (-1: read row 0) of q [B, S, H, d], rotated."""
        q = q.gather(1, rows.clamp(min=0)[:, :, None, None].expand(-1, -1, *q.shape[2:])).transpose(1, 2)
        if rotary is None:
            return q
        cos, sin = (t.expand(q.shape[0], *t.shape[1:]) for t in rotary)
        row_cos, row_sin = (t.gather(1, rows.clamp(min=0)[:, :, None].expand(-1, -1, t.shape[-1])) for t in (cos, sin))
        return self._rotary(q, q, row_cos, row_sin)[0]

    def attention_rows(self, rows: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """[B, H, R, S] causal attention of query rows `rows` [B, R] (sequence indices) over the S keys, padding
        (`key_valid` [B, S] False) excluded."""
        q, k, rotary = self._take(key_valid)
        q = self._row_queries(q, rotary, rows)
        return causal_rows_probs(q, self._rotated_keys(k, rotary), rows, key_valid, self.attention.scaling)

    def visual_attention(
        self, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor, keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, R, V] head-mean causal attention of query rows `rows` [B, R] (sequence indices, -1: none) to the key
        slots `visual` [B, V] (-1: none), padding (`key_valid` [B, S] False) excluded; one fused op. `keys`: the
        layer's rotated keys [B, Hkv, S, d] where the cache already holds them (else rotated here)."""
        q, k, rotary = self._take(key_valid)
        scale = float(self.attention.scaling)
        if self._fusable(q, rotary):  # rotary applied inside the op: rows and keys are read as captured
            cos, sin = rotary
            rotate = keys is None
            keys = k.transpose(1, 2) if rotate else keys
            return rotary_visual_attention(q, keys, cos, sin, rows, key_valid, visual, scale, rotate)
        q = self._row_queries(q, rotary, rows)
        keys = self._rotated_keys(k, rotary) if keys is None else keys
        return visual_attention(q, keys, rows, key_valid, visual, scale)

    def _fusable(self, q: torch.Tensor, rotary: Any) -> bool:
        """`rotary_visual_attention` covers this rotary: the model's is the rotate-half form over the whole head
        (checked once per model function), its tables [B or 1, S, head_dim] per sequence slot."""
        if not self._rotate_half or not isinstance(rotary, tuple) or len(rotary) != 2:
            return False
        cos, sin = rotary
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.shape != sin.shape:
            return False
        return cos.dim() == 3 and cos.shape[0] in (1, q.shape[0]) and tuple(cos.shape[1:]) == (q.shape[1], q.shape[3])

    def plain_attention(self, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
        """[B, R, V] the attention of query rows `rows` [B, R] (sequence indices, -1: none) to the key slots `visual`
        [B, V] (-1: none) as the layer would compute it without rotary and without a causal mask, the largest over
        heads (`plain_attention_max`; each head with its KV group); padding (`key_valid` [B, S] False) excluded."""
        q, k, _ = self._take(key_valid)
        q = q.gather(1, rows.clamp(min=0)[:, :, None, None].expand(-1, -1, *q.shape[2:]))
        return plain_attention_max(q, k, key_valid, visual, float(self.attention.scaling))

    def step_attention(self, keys: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
        """[B, V] head-mean attention of the last token of this decoding step (its captured query, rotary applied)
        over the key slots `visual` [B, V] of `keys` [B, Hkv, S, d], the layer's cache after the step (post-rotary,
        the new tokens last); padding (`key_valid` [B, S] False) excluded. One fused op."""
        q, _, rotary = self._take(key_valid)
        q = q[:, -1:].transpose(1, 2)  # [B, H, 1, d]
        if rotary is not None:
            cos, sin = (t[:, -1:].expand(q.shape[0], 1, t.shape[-1]) for t in rotary)
            q = self._rotary(q, q, cos, sin)[0]
        rows = torch.full((keys.shape[0], 1), keys.shape[2] - 1, dtype=torch.long, device=keys.device)
        return visual_attention(q, keys, rows, key_valid, visual, float(self.attention.scaling))[:, 0]

    def keys(self, key_valid: torch.Tensor, rotated: torch.Tensor | None = None, shifted: bool = True) -> torch.Tensor:
        """[B, S, H * d] post-rotary keys of every token, heads concatenated, GQA key heads repeated (as
        `repeat_kv` groups them) so that each query head has its key. `rotated`: the layer's keys as its cache holds
        them [B, Hkv, S, d] (else rotated here from the capture).

        Each row's keys are rotated as the row alone would have them, its first real token (`key_valid` [B, S])
        at position 0: a left-padded row numbered from its padding (plain `model(**inputs)` on LLaVA-style models)
        is rotated back by that token's position (`shifted`: some row may start after column 0; else nothing to
        undo). Attention is blind to the shift (RoPE is relative); a key's own norm is not, and DART ranks by it."""
        _, k, rotary = self._take(key_valid)
        k = self._rotated_keys(k, rotary) if rotated is None else rotated
        if rotary is not None and shifted:
            first = key_valid.long().argmax(1)[:, None, None]  # [B, 1, 1] each row's first real column
            cos, sin = (t.expand(k.shape[0], *t.shape[1:]) for t in rotary)
            cos, sin = (t.gather(1, first.expand(-1, -1, t.shape[-1])) for t in (cos, sin))  # [B, 1, d]
            k = self._rotary(k, k, cos, -sin)[1]  # R(-p) R(p + i) = R(i)
        if self.heads != k.shape[1]:
            k = k.repeat_interleave(self.heads // k.shape[1], dim=1)
        return k.transpose(1, 2).flatten(2)


class _Captures:
    """One thread's captures of a `QueryKeyProbe`."""

    def __init__(self) -> None:
        self.active = False
        self.store: dict[str, Any] = {}


def _module(owner: nn.Module, name: str) -> nn.Module | None:
    found = getattr(owner, name, None)
    return found if isinstance(found, nn.Module) else None


def _rotary_function(attention: nn.Module):
    return hf.modeling_function(attention, "apply_rotary_pos_emb")


@functools.cache
def _rotate_half_form(rotary: Any, head_dim: int) -> bool:
    """Whether the model's `apply_rotary_pos_emb` is the rotate-half rotary over the whole head (Llama, Qwen2,
    Qwen2-VL's merged M-RoPE tables, Gemma): checked on small random CPU tensors, once per function and head size.
    Any other form (interleaved, partial, another signature) keeps the unfused path."""
    if rotary is None or head_dim % 2:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, head_dim, generator=g, dtype=torch.float64)
    cos, sin = torch.randn(2, 1, 3, head_dim, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = rotary(x, x, cos, sin)
    except Exception:  # noqa: BLE001  (any other signature: not this form)
        return False
    want = rotate_half_reference(x, cos, sin)
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and all(isinstance(t, torch.Tensor) and t.shape == want.shape for t in got)
        and all(torch.allclose(t, want) for t in got)
    )


def _heads(attention: nn.Module) -> int:
    heads = getattr(attention, "num_heads", None)
    return int(heads) if isinstance(heads, int) else int(attention.config.num_attention_heads)


def _kv_heads(attention: nn.Module) -> int:
    heads = getattr(attention, "num_key_value_heads", None)
    return int(heads) if isinstance(heads, int) else int(attention.config.num_key_value_heads)
