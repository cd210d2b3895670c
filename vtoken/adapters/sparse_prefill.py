"""The "sparse" stage: block-sparse attention in the LLM prefill, through transformers' own attention hook.

transformers 5.x looks every decoder layer's attention function up by name (`AttentionInterface`), and the mask
builder by the same name (`AttentionMaskInterface`; without it `create_causal_mask` returns None). We register
one function under "vtoken_sparse_<original>" with the original's mask builder, and switch only the LLM to it
(`set_attn_implementation({"text_config": name})`); `remove()` switches back and restores the configs' stored
implementation exactly. Nothing else of the model is touched: no module forward is replaced.

The function runs the model's own attention (the original implementation, with the mask it was given) unless the
call is a prefill (as many queries as keys: no cached prefix, no decoding step) of at least `min_length` tokens on
a sparse layer, with the usual causal + key-padding mask, and the break-even model of the GPU
(`vtoken.kernels.sparse_speed`, by GPU name; `vtoken.warmup` measures an unknown one) predicts that the plan's
density gains at that length. Then it plans (`SparsePrefill.plan`) and runs the chosen backend (the Triton kernel,
FlexAttention or the PyTorch reference) on rows aligned to start at column 0 (left padding moved to the end and
back, so a padded batch plans like its rows one by one). When a prefill-stage method (FastV, MustDrop) has shortened
the sequence, the layers after the drop receive its mask and are planned on the shorter sequence.

Nothing is read back from the GPU (the "grid" pattern's frame layout aside): what a layer's mask is, is known from
how it was made (the registered mask builder sees the mask function transformers asked for: the plain causal one,
or one with sliding windows, chunks or packed sequences, which run the model's own attention), its key padding is
the mask's last row, kept on the device; the decision is host arithmetic on the planned density; the records
(achieved densities, kernel times) are built when read, after the call. Under `backend="auto"` a backend that fails
falls back to the model's own attention with one warning, never failing the forward; what "auto" measures and
what Triton and FlexAttention compile on a first call, `vtoken.warmup` does before any request (`warm`).
The records say, per layer, which attention ran and why; a call that ran the model's own attention says why in
one note.

Per-call state (records, the call's frame layout for "grid") lives per thread (`state.PerThread`), so threads
calling one patched model at once do not mix their calls.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vtoken.errors import VTokenError
from vtoken.kernels import block_sparse_attention, block_sparse_attention_reference
from vtoken.kernels.block_sparse_flex import block_sparse_attention_flex, flex_unavailable
from vtoken.kernels.sparse_speed import (
    BACKEND_CHOICE,
    BreakEven,
    available_backends,
    cpu_backend,
    device_name,
    recorded_break_even,
    warn_unmeasured,
)
from vtoken.methods.sparse_prefill import SparsePrefill, a_shape_blocks, a_shape_count, a_shape_plan, density_plan
from vtoken.records import LazyRecords, Record
from vtoken.timing import Stopwatch

from . import hf
from .compiled import eager
from .state import PerThread

# attention module -> its stage, both weakly held: a patched model dropped without `unpatch` is still freed
_STAGES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[SparseAttention]] = weakref.WeakKeyDictionary()
# the prefill whose masks transformers is building on this thread (set around the LLM's forward)
_BUILDING = threading.local()


@eager
def sparse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query [B, H, S, d], key/value [B, Hkv, S, d] -> ([B, S, H, d], None)."""
    ref = _STAGES.get(module)
    stage = ref() if ref is not None else None
    if stage is None:
        raise VTokenError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs vtoken's sparse attention but "
            "is not part of a model patched with sparse_prefill (a copy of a patched model?); patch the model itself"
        )
    return stage.attend(module, query, key, value, attention_mask, **kwargs)


def _mask_built(mask: Any, plain: bool) -> None:
    """The registered mask builder made `mask` for this thread's prefill: remember how (the plain causal + padding
    mask or another), so that a layer receiving it knows without reading it."""
    call = getattr(_BUILDING, "call", None)
    if call is not None and isinstance(mask, torch.Tensor):
        call.built[id(mask)] = (mask, plain)


def _register(original: str) -> str:
    name = f"vtoken_sparse_{original}"
    hf.register_attention(name, sparse_attention_forward, like=original, on_mask=_mask_built)
    return name


def sparse_stages(model: nn.Module) -> list[SparseAttention]:
    """The sparse stages installed on `model` (one per patched model; none if it has no sparse_prefill)."""
    found: dict[int, SparseAttention] = {}
    for module in model.modules():
        ref = _STAGES.get(module)
        stage = ref() if ref is not None else None
        if stage is not None:
            found[id(stage)] = stage
    return list(found.values())


@dataclass
class _Layer:
    """What one sparse layer of one prefill did (numbers read when the LLM returns)."""

    index: int
    counts: torch.Tensor  # [B, H, Qb] key blocks computed
    real_blocks: torch.Tensor  # [B] query blocks holding real tokens
    lengths: torch.Tensor  # [B] real tokens
    estimate: Stopwatch
    attention: Stopwatch
    backend: str  # "triton", "flex" or "torch"
    why: str


@dataclass
class _Rows:
    """A layer mask read as causal + key padding, with what aligning its rows needs (the same for every layer)."""

    ok: bool
    key_valid: torch.Tensor | None = None  # [B, S] aligned (real tokens from column 0); None: no padding
    shift: torch.Tensor | None = None  # [B] each row's first real column (0 without left padding); None: no mask
    lengths: torch.Tensor | None = None  # [B] real tokens
    last: torch.Tensor | None = None  # [B] one past each row's last real token (aligned)
    mask: torch.Tensor | None = None  # held for the call, so no later mask can reuse its memory (the cache key)
    why: str = ""  # why the mask is not causal + key padding


@dataclass
class _Verdict:
    """Whether layers of one sequence length run sparse, on which backend, and why."""

    sparse: bool
    backend: str  # "triton", "flex", "torch", or "measure" (auto on CUDA: time both on the first call)
    why: str
    density: float  # the plan's density, known before planning


class _Local:
    """One thread's state: its current prefill."""

    def __init__(self) -> None:
        self.call: _Call | None = None


@dataclass
class _Call:
    """One LLM prefill on one thread."""

    length: int
    video: list[list[torch.Tensor]] | None = None  # grid: per row, per video, [F, 2] frame columns in the LLM
    layers: list[_Layer] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)  # why some layers ran the model's own attention
    masks: dict[Any, _Rows] = field(default_factory=dict)  # per layer mask (one for all layers, another after a drop)
    verdicts: dict[int, _Verdict] = field(default_factory=dict)  # per sequence length
    plans: dict[Any, tuple] = field(default_factory=dict)  # a_shape / grid plans, per sequence length and mask
    built: dict[int, tuple[torch.Tensor, bool]] = field(default_factory=dict)  # masks the builder made: how


class SparseAttention:
    """Installs one `SparsePrefill` on one model (through its adapter)."""

    def __init__(self, adapter, method: SparsePrefill):
        self.adapter = adapter
        self.method = method
        self.model = adapter.model
        self.lm = adapter.language_model
        layers = getattr(self.lm, "layers", None)
        softmax = [i for i, layer in enumerate(layers or []) if hasattr(layer, "self_attn")]
        if not softmax:
            raise VTokenError(f"sparse_prefill: {type(self.lm).__name__} has no decoder layers with self_attn")
        # hybrid LLMs (Qwen3.5): linear-attention layers keep their own recurrent path; only softmax layers go sparse
        self.attention_modules = [layers[i].self_attn for i in softmax]
        chosen = method.check_layers(len(layers))
        other = [i for i in chosen if i not in softmax]
        if other and method.layers is not None:
            kinds = sorted({type(getattr(layers[i], "linear_attn", layers[i])).__name__ for i in other})
            raise VTokenError(
                f"sparse_prefill: layers {other} of {type(self.lm).__name__} are not softmax attention "
                f"({', '.join(kinds)}: a recurrent state, no attention matrix to make sparse); its attention layers "
                f"are {softmax}"
            )
        self.sparse_layers = frozenset(i for i in chosen if i in softmax)
        self.original = hf.attention_implementation(self.lm)
        if self.original not in hf.MASK_FUNCTIONS:
            raise VTokenError(
                f"sparse_prefill stands in for the LLM's 'sdpa' or 'eager' attention; this model's LLM uses "
                f"{self.original!r}: load it with attn_implementation='sdpa'"
            )
        device = next(self.lm.parameters()).device
        if method.backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise VTokenError(f"sparse_prefill: backend='triton' needs the LLM on a CUDA device; it is on {device}")
        if method.backend == "flex" and flex_unavailable(device.type) is not None:
            raise VTokenError(f"sparse_prefill: backend='flex': {flex_unavailable(device.type)}")
        if method.pattern == "grid" and not adapter.takes_video:
            raise VTokenError(
                f"sparse_prefill: pattern='grid' follows video frames, which {adapter.family} does not take; use "
                "'a_shape' or 'vertical_slash'"
            )
        if method.pattern == "grid":
            adapter.check_frame_layout()  # what the family needs to find frames in a prompt (raises if missing)
        self._local = PerThread(_Local)  # per thread; a copy starts empty
        self._failed: str | None = None  # auto: why the sparse backends failed (the model's own attention since)
        self._saved: list[tuple[Any, Any]] = []

    # ----------------------------------------------------------------- install / remove
    @property
    def follows_frames(self) -> bool:
        """The pattern follows video frames ("grid"): the call path notes every call's frames for it."""
        return self.method.pattern == "grid"

    def install(self, hooks) -> None:
        """Install through the model's `HookOwner`: the attention function the LLM's layers call (restored exactly
        on removal) and the hooks around the LLM that open and close a prefill."""
        self._saved = hf.stored_attention(self.model)
        for module in self.attention_modules:
            _STAGES[module] = weakref.ref(self)
        hooks.on_remove(self.remove)
        hf.set_text_attention(self.model, _register(self.original))
        hooks.before_forward(self.lm, self._before_lm)
        hooks.after_forward(self.lm, self._after_lm)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A deep copy or an unpickled copy of a patched model: its attention modules run its own stage."""
        self.__dict__.update(state)
        if self._saved:  # installed
            for module in self.attention_modules:
                _STAGES[module] = weakref.ref(self)

    def remove(self) -> None:
        """Undo `install`'s attention registration (the hook owner removes the hooks)."""
        for module in self.attention_modules:
            _STAGES.pop(module, None)
        if self._saved:
            hf.set_text_attention(self.model, self.original)
            hf.restore_attention(self._saved)  # exactly what each config stored before
            self._saved = []

    # ----------------------------------------------------------------- per call
    @eager
    def _before_lm(self, module, args, kwargs) -> None:
        embeds = kwargs.get("inputs_embeds")
        shape = embeds.shape[:2] if embeds is not None else kwargs["input_ids"].shape
        cache = hf.cache_in(kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        call = _Call(int(shape[1])) if past == 0 else None
        if call is not None and self.method.pattern == "grid":
            call.video = self._video_layout(tuple(shape))
        self._local.get().call = call
        _BUILDING.call = call

    @eager
    def _after_lm(self, module, args, output) -> None:
        call, self._local.get().call = self._local.get().call, None
        _BUILDING.call = None
        if call is None:
            return
        call.masks, call.plans, call.built = {}, {}, {}  # the masks go with the call; the records need none of them
        self.adapter.add_records(LazyRecords(lambda: self._records(call)))  # read when asked for, after the call

    def _records(self, call: _Call) -> list[Record]:
        method = self.method
        if method.is_identity:
            return [self._note("dense: density=1.0 computes every block, so the model's own attention runs")]
        if call.length < method.min_length:
            reason = f"dense: the prompt's {call.length} tokens are fewer than min_length={method.min_length}"
            return [self._note(reason)]
        records = [self._note(f"dense: {reason}") for reason in dict.fromkeys(call.dense)]
        if not call.layers:
            return records
        rows = []  # per layer: [2, B] achieved density and real tokens, read back in one transfer
        for layer in call.layers:
            blocks = layer.real_blocks
            qb = torch.arange(layer.counts.shape[-1], device=blocks.device)
            real = qb[None, :] < blocks[:, None]  # [B, Qb]
            computed = (layer.counts.sum(1) * real).sum(1).double()
            causal = blocks.double() * (blocks.double() + 1) / 2 * layer.counts.shape[1]
            rows.append(torch.stack([computed / causal.clamp(min=1), layer.lengths.double()]))
        numbers = torch.stack(rows).tolist()
        for layer, (density, lengths) in zip(call.layers, numbers, strict=True):
            lengths = [int(n) for n in lengths]
            extra = dict(pattern=method.pattern, block_size=method.block_size, attention=layer.backend, why=layer.why)
            extra.update(estimation_ms=layer.estimate.seconds * 1e3, attention_ms=layer.attention.seconds * 1e3)
            records += [
                Record(
                    f"sparse.layer{layer.index}",
                    method.name,
                    image=row,
                    crop=0,
                    tokens_in=lengths[row],
                    tokens_out=lengths[row],
                    kept=None,
                    grid=(1, lengths[row]),
                    timer=layer.estimate,
                    share=1 / len(lengths),
                    extra=dict(extra, density=density[row]),
                )  # fmt: skip
                for row in range(len(lengths))
            ]
        return records

    def _note(self, reason: str) -> Record:
        timer = Stopwatch(torch.device("cpu")).start().stop()
        extra = {"dense": reason, "attention": self.original}
        return Record("sparse", self.method.name, image=0, crop=0, tokens_in=0, tokens_out=0, kept=None,
                      grid=(1, 0), timer=timer, share=0.0, extra=extra)  # fmt: skip

    # ----------------------------------------------------------------- the attention function
    def _original(self, module, query, key, value, attention_mask, **kwargs):
        attend = hf.attention_function(self.original, module)
        return attend(module, query, key, value, attention_mask, **kwargs)

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        call = self._local.get().call
        method = self.method
        seq = query.shape[2]
        if (
            call is None
            or method.is_identity
            or module.layer_idx not in self.sparse_layers
            or seq != key.shape[2]
            or seq < method.min_length
            or module.training
            or kwargs.get("sliding_window") is not None
            or kwargs.get("output_attentions")
            or kwargs.get("softcap") is not None
        ):
            return self._original(module, query, key, value, attention_mask, **kwargs)
        if self._failed is not None and method.backend == "auto":
            call.dense.append(f"the sparse backends failed earlier in this process ({self._failed})")
            return self._original(module, query, key, value, attention_mask, **kwargs)
        rows = self._rows(call, attention_mask, seq)
        video = call.video
        if rows.ok and method.pattern == "grid" and (video is None or seq != call.length):
            call.dense.append(f"layer {module.layer_idx}: no frame layout for this sequence (grid)")
            return self._original(module, query, key, value, attention_mask, **kwargs)
        if not rows.ok:
            call.dense.append(f"layer {module.layer_idx}: {rows.why}")
            return self._original(module, query, key, value, attention_mask, **kwargs)
        verdict = self._verdict(call, query, key, seq, rows)
        if not verdict.sparse:
            call.dense.append(verdict.why)
            return self._original(module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling")
        scale = scale if scale is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
        try:
            out = self._sparse(module.layer_idx, scale, query, key, value, rows, call, verdict)
        except Exception as error:  # auto promises a forward that never fails for its backends: dense instead
            if method.backend != "auto":
                raise
            self._fail(error)
            call.dense.append(f"layer {module.layer_idx}: the sparse backend failed ({self._failed})")
            return self._original(module, query, key, value, attention_mask, **kwargs)
        return out.transpose(1, 2).contiguous(), None

    def _fail(self, error: Exception) -> None:
        """Remember that the sparse backends failed under auto (the model's own attention from now on), once, with a
        warning naming the error."""
        if self._failed is None:
            self._failed = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"vtoken sparse_prefill: the sparse attention backend failed ({self._failed}); backend='auto' falls "
                "back to the model's own attention from now on (pass backend='triton', 'flex' or 'torch' to see the "
                "error raised)",
                UserWarning,
                stacklevel=3,
            )

    def _rows(self, call: _Call, mask: torch.Tensor | None, seq: int) -> _Rows:
        """The layer mask, once per call (every layer gets the same tensor; a drop passes a new one), read without
        reading the device: what it is comes from how the registered builder made it (`_mask_built`), its key
        padding is its last row (causal-complete), aligned on the device."""
        cache_key = None if mask is None else (mask.data_ptr(), tuple(mask.shape), mask.dtype, str(mask.device))
        rows = call.masks.get(cache_key)
        if rows is None:
            rows = causal_padding_rows(mask, seq, call.built.get(id(mask)))
            call.masks[cache_key] = rows
        return rows

    def _verdict(self, call: _Call, q: torch.Tensor, k: torch.Tensor, seq: int, rows: _Rows) -> _Verdict:
        """Sparse or the model's own attention for layers of `seq` tokens, on which backend, and why: decided once
        per call and length, on the host, from the plan's density known before planning."""
        verdict = call.verdicts.get(seq)
        if verdict is not None:
            return verdict
        method = self.method
        device = q.device
        video = self._aligned_video(call.video, rows) if method.pattern == "grid" else None
        density = method.planned_density(seq, video)
        backend, why_backend = self._backend(q, k, seq, density, rows)
        model = method.break_even if isinstance(method.break_even, BreakEven) else None
        if method.break_even is True:
            model = recorded_break_even(device)  # measured at warm-up, else recorded for this GPU's name
            if model is None and device.type == "cuda":
                warn_unmeasured(device_name(device))
        if backend == "torch" and device.type == "cuda" and method.backend == "auto" and method.break_even:
            why = ("no block-sparse kernel on cuda (install triton, or torch 2.5+ for FlexAttention): the dense "
                   "reference would be slower than the model's own attention")  # fmt: skip
            verdict = _Verdict(False, backend, why, density)
        elif model is None:
            source = (
                "break_even=False"
                if method.break_even is False
                else f"no speed model recorded for {device_name(device)}"
                + (" (vtoken.warmup measures one)" if device.type == "cuda" else "")
            )
            verdict = _Verdict(
                True, backend, f"{source}: min_length={method.min_length} decides; {why_backend}", density
            )
        else:
            sparse, why = model.decide(seq, density, estimated=method.pattern == "vertical_slash")
            verdict = _Verdict(sparse, backend, f"{why}; {why_backend}" if sparse else why, density)
        call.verdicts[seq] = verdict
        return verdict

    def _backend(self, q: torch.Tensor, k: torch.Tensor, seq: int, density: float, rows: _Rows) -> tuple[str, str]:
        """The backend of `method.backend` on this device, and why (auto: see `vtoken.kernels.sparse_speed`)."""
        method = self.method
        if method.backend != "auto":
            return method.backend, f"backend={method.backend!r}"
        if q.device.type != "cuda":
            chosen = cpu_backend(q.shape[0], q.shape[1], seq)
            return chosen, f"auto on {q.device.type}: {chosen} (no measuring off CUDA)"
        kernels = [name for name in available_backends("cuda") if name != "torch"]
        if len(kernels) <= 1:
            chosen = kernels[0] if kernels else "torch"
            return chosen, f"auto on cuda: {chosen}, the only block-sparse kernel available"
        key = BACKEND_CHOICE.shape_class(q, k, method.block_size, density, rows.key_valid is not None, self._window())
        known = BACKEND_CHOICE.known(key)
        return (known or "measure"), "auto on cuda: the faster backend measured for this shape"

    def _window(self) -> int:
        return self.method.local if self.method.pattern == "a_shape" else 0

    @staticmethod
    def _aligned_video(video, rows: _Rows):
        if video is None or rows.shift is None:
            return video
        moved = zip(video, rows.shift.tolist(), strict=True)
        return [[frames - offset for frames in row] for row, offset in moved]

    def _plan(self, q, k, scale, rows: _Rows, call: _Call) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The layer's plan with all-padding query blocks emptied; a_shape and grid plans once per call."""
        method = self.method
        seq = q.shape[2]
        fixed = method.pattern != "vertical_slash"
        cache_key = (seq, id(rows))  # `rows` lives in `call.masks` for the whole call
        if fixed and cache_key in call.plans:
            return call.plans[cache_key]
        video = self._aligned_video(call.video, rows) if method.pattern == "grid" else None
        counts, index, window = method.plan(q, k, rows.key_valid, scale, video)
        if rows.last is not None:
            real_blocks = -(-rows.last // method.block_size)
            blocks = torch.arange(counts.shape[-1], device=q.device)
            counts = counts * (blocks[None, None, :] < real_blocks[:, None, None])  # no work on all-padding blocks
        plan = (counts, index, window)
        if fixed:
            call.plans[cache_key] = plan
        return plan

    def _sparse(
        self, index, scale, q, k, v, rows: _Rows, call: _Call, verdict: _Verdict, plan: tuple | None = None
    ) -> torch.Tensor:
        """[B, H, S, d] attention of one prefill layer under the method's plan (`plan`: a given one, warm-up)."""
        method = self.method
        batch, _, seq, _ = q.shape
        key_valid = rows.key_valid
        if rows.shift is not None:
            q, k, v = (_roll(x, rows.shift) for x in (q, k, v))
        estimate = Stopwatch(q.device).start()
        counts, index_, window = plan if plan is not None else self._plan(q, k, scale, rows, call)
        estimate.stop()
        if rows.last is not None:
            real_blocks, lengths = -(-rows.last // method.block_size), rows.lengths
        else:
            lengths = torch.full((batch,), seq, device=q.device)
            real_blocks = torch.full((batch,), -(-seq // method.block_size), device=q.device)
        attention = Stopwatch(q.device).start()
        args = (q, k, v, counts, index_, method.block_size, scale, key_valid, method.sink if window else 0, window)
        backend, out = verdict.backend, None
        if backend == "measure":  # auto on CUDA, first call of this shape class: time both kernels on these inputs
            key = BACKEND_CHOICE.shape_class(q, k, method.block_size, verdict.density, key_valid is not None, window)
            runs = {"triton": lambda: block_sparse_attention(*args), "flex": lambda: block_sparse_attention_flex(*args)}
            backend, out = BACKEND_CHOICE.pick(key, runs)
        if out is None:
            out = run_backend(backend, args)
        attention.stop()
        if rows.shift is not None:
            out = _roll(out, -rows.shift)
            columns = torch.arange(seq, device=q.device)
            seeing_nothing = (columns[None, :] < rows.shift[:, None])[:, None, :, None]  # the left padding's rows
            out = out.masked_fill(seeing_nothing, 0.0)
        call.layers.append(_Layer(index, counts, real_blocks, lengths, estimate, attention, backend, verdict.why))
        return out

    # ----------------------------------------------------------------- warm-up (outside any request)
    def _attention_shape(self) -> tuple[int, int, int, float, torch.device, torch.dtype]:
        """(query heads, key/value heads, head dim, scale, device, dtype) of the LLM's sparse layers."""
        config = self.lm.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        module = self.attention_modules[0]
        dim = getattr(module, "head_dim", None) or config.hidden_size // heads
        parameter = next(self.lm.parameters())
        return heads, kv_heads, dim, getattr(module, "scaling", dim**-0.5), parameter.device, parameter.dtype

    def _inputs(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads, kv_heads, dim, _, device, dtype = self._attention_shape()
        g = torch.Generator(device=device).manual_seed(length)
        q = torch.randn(batch, heads, length, dim, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(batch, kv_heads, length, dim, device=device, dtype=dtype, generator=g) for _ in "kv")
        return q, k, v

    def warm(self, lengths: list[int], batches: list[int]) -> list[str]:
        """Run one sparse layer at every prompt length and batch size, padded rows and not, on random inputs of the
        LLM's attention shape: what the first request of each would do once (FlexAttention's compilation per
        length bucket, Triton's autotuning, auto's backend measurement), outside any request. One line per shape
        says what runs there and why."""
        method = self.method
        _, _, _, scale, device, _ = self._attention_shape()
        done = []
        for length in lengths:
            for batch in batches:
                for padded in (False, True):
                    q, k, v = self._inputs(batch, length)
                    rows = _Rows(True)
                    if padded:  # a padded batch's shapes and kernels (key padding given), every key real here
                        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
                        last = torch.full((batch,), length, device=device)
                        rows = _Rows(True, valid, torch.zeros(batch, dtype=torch.long, device=device), last, last)
                    call = _Call(length)
                    plan = None
                    if method.pattern == "grid":  # its plans follow each prompt's frames: the A-shape's kernels
                        counts, index = a_shape_plan(length, method.block_size, method.sink, method.local, device)
                        plan = (counts.expand(batch, q.shape[1], -1), index.expand(batch, q.shape[1], -1, -1), 0)
                        verdict = _Verdict(True, self._backend(q, k, length, 0.5, rows)[0], "warm-up", 0.5)
                    else:
                        verdict = self._verdict(call, q, k, length, rows)
                    shape = f"{length} tokens x {batch}{' (padded)' if padded else ''}"
                    if length < method.min_length or method.is_identity or not verdict.sparse:
                        done.append(f"{shape}: the model's own attention ({verdict.why or 'min_length'})")
                        continue
                    self._sparse(0, scale, q, k, v, rows, call, verdict, plan)
                    done.append(f"{shape}: sparse on {call.layers[-1].backend}")
        return done

    def measure_break_even(self, lengths: list[int], repeats: int = 5) -> BreakEven:
        """This GPU's `BreakEven` for the method's pattern: at each length, one row of the LLM's attention shape,
        SDPA's causal attention (the dense layer) against the sparse kernel (the backend auto picks) at each of
        `KERNEL_DENSITIES`, and the vertical-slash estimate (its plan) against SDPA."""
        from vtoken.kernels.sparse_speed import KERNEL_DENSITIES, measure_break_even

        method = self.method
        _, _, _, scale, device, _ = self._attention_shape()
        rows = _Rows(True)

        def dense(length: int):
            q, k, v = self._inputs(1, length)
            return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def sparse(length: int, density: float):
            q, k, v = self._inputs(1, length)
            block = method.block_size
            mandatory = a_shape_blocks(length, block, method.sink, method.local, device)
            g = torch.Generator(device=device).manual_seed(length)
            lines = [torch.rand(1, q.shape[1], length, device=device, generator=g) for _ in "vs"]
            widest = a_shape_count(-(-length // block) - 1, block, method.sink, method.local)
            counts, index = density_plan(*lines, block, density, mandatory, widest)
            backend = self._backend(q, k, length, density, rows)[0]
            args = (q, k, v, counts, index, block, scale, None, 0, 0)
            if backend == "measure":
                key = BACKEND_CHOICE.shape_class(q, k, block, density, False, 0)
                runs = {
                    "triton": lambda: block_sparse_attention(*args),
                    "flex": lambda: block_sparse_attention_flex(*args),
                }
                backend = BACKEND_CHOICE.pick(key, runs)[0]
            return lambda: run_backend(backend, args)

        def estimate(length: int):
            q, k, _ = self._inputs(1, length)
            return lambda: method.plan(q, k, None, scale)

        return measure_break_even(
            dense, sparse, estimate if method.pattern == "vertical_slash" else None, lengths, KERNEL_DENSITIES,
            repeats=repeats, source=f"measured by vtoken.warmup on {device_name(device)} ({method.pattern}, block "
            f"{method.block_size}, {self._attention_shape()[0]}/{self._attention_shape()[1]} heads)",
        )  # fmt: skip

    # ----------------------------------------------------------------- grid: the call's frame layout
    def _video_layout(self, shape: tuple[int, int]) -> list[list[torch.Tensor]] | None:
        """Per row, per video, [F, 2] frame columns in this LLM call (None: no frame layout), from its input_ids and
        the call's videos (noted by the call path), as the adapter finds them."""
        state = self.adapter.calls.state
        ids, frames = state.ids, state.frames
        if ids is None or tuple(ids.shape) != shape:
            return None
        return self.adapter.frame_spans(ids, frames)


def run_backend(backend: str, args: tuple) -> torch.Tensor:
    """Block-sparse attention of `args` (the kernels' common signature) on `backend`."""
    if backend == "torch":
        return block_sparse_attention_reference(*args)
    if backend == "flex":
        return block_sparse_attention_flex(*args)
    if backend == "triton" and not args[0].is_cuda:  # the Triton interpreter (tests): the launcher itself
        from vtoken.kernels import block_sparse_attention_triton

        return block_sparse_attention_triton(*args)
    return block_sparse_attention(*args)  # the custom op: the Triton kernel on CUDA


def causal_padding_rows(mask: torch.Tensor | None, seq: int, built: tuple[torch.Tensor, bool] | None) -> _Rows:
    """A layer's mask as causal + key padding, from how it was made (`built`: the tensor the registered builder
    returned for this call and whether it was asked for the plain causal mask), without reading it: None (SDPA's
    plain causal, no padding), or a [B, 1, S, S] boolean (SDPA) or additive float (eager) mask of the builder's,
    whose last row gives the key padding. Any other mask (one passed in 4-D, a sliding window, packed sequences)
    is not known to be causal + key padding: the layer runs the model's own attention."""
    if mask is None:
        return _Rows(True)
    if built is None or built[0] is not mask:
        return _Rows(False, mask=mask, why="its mask was not made by transformers' causal mask builder in this call")
    if not built[1]:
        return _Rows(False, mask=mask, why="its mask is not causal + key padding (a window, chunks or packing)")
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[-2:]) != (seq, seq):
        return _Rows(False, mask=mask, why=f"its mask has shape {tuple(mask.shape)}, not [B, 1, {seq}, {seq}]")
    last = mask[:, 0, -1, :]  # the last query row sees every real key
    key_valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    shift = key_valid.long().argmax(1)  # first real column of each row (0 where none is left-padded)
    key_valid = _roll(key_valid, shift)
    positions = torch.arange(seq, device=key_valid.device)
    last_real = torch.where(key_valid, positions, -1).amax(1) + 1
    return _Rows(True, key_valid, shift, key_valid.sum(1), last_real, mask=mask)


def _roll(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [B, ..., S, ...] (S at dim 2 for 4-D, dim 1 for 2-D) with row b rolled left by shift[b]."""
    dim = 2 if x.dim() == 4 else 1
    seq = x.shape[dim]
    index = (torch.arange(seq, device=x.device)[None, :] + shift[:, None]) % seq  # [B, S]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = seq
    return x.gather(dim, index.view(shape).expand_as(x))
