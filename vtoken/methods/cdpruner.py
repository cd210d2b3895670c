"""CDPruner: keep the crop's tokens that a conditional DPP finds most diverse *given the instruction* (Zhang et
al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in MLLMs", NeurIPS 2025;
official code Theia-4869/CDPruner). Written from vtoken's METHODS-3-images.md.

Per crop of N projected tokens v (what the LLM would receive) and a budget of T tokens:

1. Relevance: image embeds g = CLIP `visual_projection` of the tower's own `post_layernorm` applied to the
   feature-layer patches (the official quirk: layer -2, not the last), and text embeds t = the question's CLIP
   text embeddings (the prompt's last user turn without the lmms-eval answer-format suffixes, CLIP-tokenised with
   its special tokens and no truncation, cut into rows of 77 tokens; `text_projection` of each row's pooled
   output). r_raw = mean over rows of -cos(g_j, t_m) (negated, as the official code). One min-max per *image*
   over every valid token of its crops: r = (r_raw - min + 1e-6) / (max - min) (r = 1 where max = min; the
   official divides by zero there, and takes min/max over the whole batch of crops, which is the same for one
   image per call).
2. Kernel: S = cos(v_i, v_j) in fp32, L = diag(q) S diag(q) with q = r, or with `theta` in (0, 1)
   q = exp(theta / (2 (1 - theta)) r) (the paper's re-weighting, commented out in the official code).
3. Fast greedy MAP inference (Chen et al. 2018), T steps, the first index on ties (`vtoken::dpp_greedy`: one
   Triton launch for every crop on CUDA). A token whose gain is zero up to rounding (at most 1e-4 of its own
   diagonal entry: it lies in the span of the picks, e.g. a duplicate) adds nothing and is not picked. Once no
   token adds anything (T above the rank of S, which is at most the projected width) the official code takes a
   square root of a non-positive number and keeps fewer than T tokens; here the remaining picks are the unpicked
   tokens by descending r (the first index on ties), so exactly T are kept. Kept: ascending.

`relevance="llm"` is vtoken's variant for families without a CLIP text tower (Qwen, InternVL, ...): g = the
projected tokens themselves, t = the LLM's input embeddings of the question's tokens; the rest is the same.

No host sync: counts come from the budget and the adapter's host-side token counts; the question's text
embeddings are computed once per distinct set of questions (its token ids are an input that travels to the device
like the prompt's) and cached.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..errors import VTokenError
from ..params import Choice, OrNone, Param, Real, Texts
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod
from .mmtok import LMMS_EVAL_SUFFIXES

if TYPE_CHECKING:
    from ..modelview import ModelView

DEFAULT_CLIP = "openai/clip-vit-large-patch14-336"
# vision widths of CLIP checkpoints LLaVA towers come from, to check a model against them without the hub
KNOWN_VISION_WIDTHS = {"openai/clip-vit-large-patch14-336": 1024, "openai/clip-vit-large-patch14": 1024}
RELEVANCES = ("clip", "llm")
EXHAUSTED = 1e-4  # a token adds nothing once its gain is at most this share of its diagonal entry of L (rounding)
TEXT_CACHE = 16  # distinct question sets whose text embeddings a method keeps
FAILED_LOOKUP_SECONDS = 300.0  # a CLIP checkpoint that failed to load is not tried again for this long


def clean_question(question: str) -> str:
    """The question as the official eval scripts pass it: without the lmms-eval answer-format suffixes."""
    for suffix in LMMS_EVAL_SUFFIXES:
        question = question.replace(suffix, " ")
    return " ".join(question.split())


@dataclass
class ClipText:
    """What CDPruner uses of a CLIP checkpoint: the text tower with its projection, the image projection and the
    tokenizer. segment: the text tower's positions (77): longer questions are cut into rows of this length.
    vision_norm: the checkpoint's vision `post_layernorm` (fp32), for engines whose LLaVA tower is built without its
    own (vLLM builds it up to the feature layer): LLaVA-1.5/NeXT's towers are CLIP-L/336's, frozen, so it is theirs."""

    text_model: torch.nn.Module
    text_projection: torch.nn.Module
    visual_projection: torch.Tensor  # [E, Dv] fp32
    tokenizer: Any
    segment: int
    vision_norm: torch.nn.Module | None = None

    @classmethod
    def of(cls, model: Any, tokenizer: Any, device: torch.device, vision_norm: Any = None) -> ClipText:
        text_model, text_projection = model.text_model, model.text_projection
        if next(text_model.parameters()).device != device:
            text_model, text_projection = _copy_to(text_model, device), _copy_to(text_projection, device)
        visual = model.visual_projection.weight.detach().to(device=device, dtype=torch.float32)
        if vision_norm is None and getattr(model, "vision_model", None) is not None:
            vision_norm = model.vision_model.post_layernorm
        norm = None if vision_norm is None else _copy_to(vision_norm, device).float()
        positions = model.config.text_config.max_position_embeddings
        return cls(text_model, text_projection, visual, tokenizer, positions, norm)

    def embed(self, questions: list[str]) -> list[torch.Tensor]:
        """Per question, [M, E] fp32 text embeddings of its rows of `segment` tokens (zero-padded, mask 0)."""
        device = self.visual_projection.device
        ids, mask, rows = [], [], []
        for question in questions:
            tokens = list(self.tokenizer(question, add_special_tokens=True, truncation=False)["input_ids"])
            count = (len(tokens) - 1) // self.segment + 1
            padding = count * self.segment - len(tokens)
            ids += _chunks(tokens + [0] * padding, self.segment)
            mask += _chunks([1] * len(tokens) + [0] * padding, self.segment)
            rows.append(count)
        ids_t = torch.tensor(ids, dtype=torch.long).to(device)
        mask_t = torch.tensor(mask, dtype=torch.long).to(device)
        pooled = self.text_model(input_ids=ids_t, attention_mask=mask_t).pooler_output
        return list(self.text_projection(pooled).float().split(rows))


def _chunks(values: list[int], size: int) -> list[list[int]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def _copy_to(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module).to(device)


_LOCK = threading.Lock()
_LOADED: dict[str, tuple[Any, Any]] = {}  # source -> (CLIPModel on the CPU, tokenizer)
_CONFIGS: dict[str, Any] = {}
_FAILED: dict[tuple, tuple[float, str]] = {}  # (source, offline) -> (when, message)


def _what_to_pass(source: str) -> str:
    return (
        f"pass clip= a local CLIP checkpoint directory or a loaded transformers.CLIPModel (with clip_tokenizer=), "
        f"or relevance='llm' (vtoken's variant: no CLIP text tower needed); {source!r} is the checkpoint the "
        "LLaVA-1.5 / LLaVA-NeXT towers come from"
    )


def _hub_source(source: str) -> dict:
    """`from_pretrained` keywords for `source`: {} for a local directory, else the hub's (offline and absent: a
    `VTokenError` naming what to pass, remembered for a while so that it is not probed again and again)."""
    if os.path.isdir(source):
        return {}
    from .. import hub

    key = (source, hub.offline())
    failed = _FAILED.get(key)
    if failed is not None and time.monotonic() - failed[0] < FAILED_LOOKUP_SECONDS:
        raise VTokenError(failed[1])
    try:
        return hub.hub_kwargs(source)
    except VTokenError as error:
        message = f"cdpruner: cannot load the CLIP checkpoint {source!r} ({error}); {_what_to_pass(source)}"
        _FAILED[key] = (time.monotonic(), message)
        raise VTokenError(message) from None


def _load_failure(source: str, what: str, error: Exception) -> VTokenError:
    return VTokenError(
        f"cdpruner: loading the CLIP {what} of {source!r} failed ({type(error).__name__}: {error}); "
        f"{_what_to_pass(source)}"
    )


def clip_config(source: str) -> Any:
    """The `CLIPConfig` of a checkpoint id or path (cached)."""
    with _LOCK:
        if source not in _CONFIGS:
            from transformers import CLIPConfig

            kwargs = _hub_source(source)
            try:
                _CONFIGS[source] = CLIPConfig.from_pretrained(source, **kwargs)
            except Exception as error:  # noqa: BLE001 - any loading failure means the same to the user
                raise _load_failure(source, "config", error) from error
        return _CONFIGS[source]


def load_clip(source: str, tokenizer: Any = None) -> tuple[Any, Any, Any]:
    """(CLIPModel in fp32 on the CPU without its vision tower, its tokenizer or `tokenizer`, the vision tower's
    `post_layernorm`) of a checkpoint id or path, loaded once."""
    with _LOCK:
        if source not in _LOADED:
            from transformers import AutoTokenizer, CLIPModel

            kwargs = _hub_source(source)
            try:
                model = CLIPModel.from_pretrained(source, dtype=torch.float32, **kwargs).eval()
            except Exception as error:  # noqa: BLE001
                raise _load_failure(source, "weights", error) from error
            try:
                loaded = AutoTokenizer.from_pretrained(source, **kwargs) if tokenizer is None else None
            except Exception as error:  # noqa: BLE001
                raise _load_failure(source, "tokenizer", error) from error
            norm = model.vision_model.post_layernorm
            model.vision_model = None  # only its projection and final norm are used: free the vision tower
            _LOADED[source] = (model, loaded, norm)
        model, loaded, norm = _LOADED[source]
        return model, tokenizer if tokenizer is not None else loaded, norm


@dataclass(frozen=True)
class ClipSource(Param):
    """A CLIP checkpoint: a hub id or a directory (str or path), or a loaded `transformers.CLIPModel`."""

    def check(self, method: Any, name: str, value: Any) -> Any:
        if isinstance(value, (str, os.PathLike)):
            value = os.fspath(value)
            if value.strip():
                return value
        elif all(hasattr(value, a) for a in ("text_model", "text_projection", "visual_projection")):
            return value
        shown = repr(value) if isinstance(value, str) else type(value).__name__
        raise VTokenError(
            f"{method.name}: {name}={shown}; expected a CLIP checkpoint id or directory (str) or a loaded "
            "transformers.CLIPModel"
        )

    def text(self) -> str:
        return "a CLIP checkpoint id or directory, or a loaded transformers.CLIPModel"


@dataclass(frozen=True)
class Tokenizer(Param):
    """A tokenizer: callable on a string, as transformers tokenizers are."""

    def check(self, method: Any, name: str, value: Any) -> Any:
        if not callable(value):
            raise VTokenError(
                f"{method.name}: {name}={type(value).__name__}; expected a tokenizer (callable on a string, as "
                "transformers tokenizers are) or None"
            )
        return value

    def text(self) -> str:
        return "a tokenizer (the CLIP checkpoint's)"


@dataclass
class CDPruner(EncoderMethod):
    """`budget`: tokens kept per crop, a count (official 64 / 128 / 192 of LLaVA-1.5's 576; LLaVA-NeXT 32 / 64 /
    128 per crop) or a fraction. `theta`: None (official: q = r) or in (0, 1): q = exp(theta / (2 (1 - theta)) r).
    `relevance`: "clip" (official) or "llm" (vtoken's variant, every family). `clip`: the CLIP checkpoint (hub id
    or directory) whose text tower and `visual_projection` give the relevance, or a loaded `transformers.CLIPModel`
    (then `clip_tokenizer` is required). `question`: overrides the question read from the prompt (one string, or
    one per batch row)."""

    budget: Budget = 64
    theta: float | None = None
    relevance: str = "clip"
    clip: Any = field(default=DEFAULT_CLIP, repr=False)
    clip_tokenizer: Any = field(default=None, repr=False)
    question: str | list[str] | None = None

    name = "cdpruner"
    scopes = ("crop",)
    modalities = ("image",)
    params = {
        "theta": OrNone(Real("(0, 1)", hint="the relevance weight; theta = 1 would weigh relevance infinitely")),
        "relevance": Choice(RELEVANCES, hint="'clip' official; 'llm' vtoken's variant for every family"),
        "clip": ClipSource(),
        "clip_tokenizer": OrNone(Tokenizer()),
        "question": OrNone(Texts()),
    }
    layouts = ("native", "official")
    controls = ("budget", "relevance")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.clip, str) and self.clip_tokenizer is None and self.relevance == "clip":
            raise VTokenError(
                f"{self.name}: clip is a loaded {type(self.clip).__name__}; pass its tokenizer as clip_tokenizer= "
                "(e.g. transformers.AutoTokenizer.from_pretrained of the same checkpoint)"
            )
        self._texts: OrderedDict = OrderedDict()  # (questions, device) -> [images, E] mean unit text embedding
        self._clip_on: dict[str, ClipText] = {}  # device -> the CLIP parts there

    @property
    def requires(self) -> tuple[str, ...]:
        signals = ("question", "projected")
        return signals + ("clip_features",) if self.relevance == "clip" else signals

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """CDPruner-LLM (`relevance="llm"`, the labelled variant) where the official CLIP relevance cannot apply:
        no CLIP text tower for the model's tower, or a tower whose width is not the default checkpoint's (the tiny
        models)."""
        width = KNOWN_VISION_WIDTHS.get(DEFAULT_CLIP)
        if "clip_features" not in model.signals or model.vision_width not in (None, width):
            return {"relevance": "llm"}
        return {}

    def missing_signal_hint(self, missing: list[str]) -> str:
        if "clip_features" in missing:
            return (
                "CDPruner's official relevance compares CLIP image embeddings of the tower's own features with the "
                "question's CLIP text embedding, which needs a CLIP vision tower whose checkpoint has a text tower "
                "(LLaVA-1.5, LLaVA-NeXT); relevance='llm' (a vtoken variant: the projected tokens against the "
                "question's LLM input embeddings) works on every family"
            )
        return ""

    def check_clip_width(self, width: int) -> None:
        """At patch: the CLIP checkpoint's vision width must be the model's tower width (its `visual_projection`
        reads the tower's own features)."""
        if isinstance(self.clip, str):
            known = KNOWN_VISION_WIDTHS.get(self.clip)
            ours = known if known is not None else clip_config(self.clip).vision_config.hidden_size
            label = repr(self.clip)
        else:
            ours, label = self.clip.visual_projection.in_features, f"the given {type(self.clip).__name__}"
        if ours != width:
            raise VTokenError(
                f"{self.name}: the CLIP checkpoint {label} has vision width {ours}, but this model's vision tower has "
                f"hidden size {width}: its visual_projection cannot read the tower's features. Pass clip= the CLIP "
                "checkpoint the tower comes from (a directory or a loaded CLIPModel), or relevance='llm'"
            )
        if isinstance(self.clip, str) and known is not None:
            clip_config(self.clip)  # offline and absent: the error now, at patch

    def clip_features(self, features: torch.Tensor) -> torch.Tensor:
        """The "clip_features" signal from a LLaVA tower's feature-layer patches [C, N, Dv] for an engine that built
        the tower without its final norm (vLLM): the CLIP checkpoint's own vision `post_layernorm`, fp32."""
        norm = self._clip_parts(features.device).vision_norm
        if norm is None:
            raise VTokenError(f"{self.name}: the CLIP checkpoint has no vision post_layernorm to make clip_features")
        return norm(features.float())

    # ----------------------------------------------------------------- the text side
    def _clip_parts(self, device: torch.device) -> ClipText:
        key = str(device)
        if key not in self._clip_on:
            if isinstance(self.clip, str):
                model, tokenizer, norm = load_clip(self.clip, self.clip_tokenizer)
            else:
                model, tokenizer, norm = self.clip, self.clip_tokenizer, None
            self._clip_on[key] = ClipText.of(model, tokenizer, device, norm)
        return self._clip_on[key]

    def text_means(self, tokens: VisualTokens, device: torch.device) -> torch.Tensor:
        """[images, E] per image, the mean of its question's L2-normalised text embeddings (so that a token's mean
        cosine over the rows is one dot product). Cached per distinct list of questions."""
        questions = tuple(clean_question(q) for q in tokens.question.questions)
        key = (questions, str(device), self.relevance)
        with _LOCK:
            means = self._texts.get(key)
            if means is not None:
                self._texts.move_to_end(key)
                return means
        distinct = list(dict.fromkeys(questions))
        with torch.no_grad():
            if self.relevance == "clip":
                rows = self._clip_parts(device).embed(distinct)
            else:
                rows = [tokens.question.embed(q).to(device) for q in distinct]
            per_question = {
                q: F.normalize(r.float(), dim=-1).mean(0) if len(r) else r.new_zeros(r.shape[-1], dtype=torch.float32)
                for q, r in zip(distinct, rows, strict=True)
            }
            means = torch.stack([per_question[q] for q in questions])
        with _LOCK:  # threads calling one patched model share the cache
            self._texts[key] = means
            if len(self._texts) > TEXT_CACHE:
                self._texts.popitem(last=False)
        return means

    # ----------------------------------------------------------------- selection
    def relevance_scores(self, tokens: VisualTokens, excluded: torch.Tensor | None, image: torch.Tensor | None):
        """r [C, N] fp32: each token's relevance, min-maxed over the valid tokens of its image's crops (0 for the
        `excluded` ones). image: [C] each crop's image, or None when every crop is an image of its own."""
        projected = tokens.signals["projected"]
        device = projected.device
        if self.relevance == "clip":
            features = tokens.signals["clip_features"].to(device).float()
            embeds = F.linear(features, self._clip_parts(device).visual_projection)
        else:
            embeds = projected.float()
        text = self.text_means(tokens, device)
        text = text if image is None else text[image]  # [C, E]
        raw = -(F.normalize(embeds, dim=-1) * text[:, None, :]).sum(-1)  # the mean over rows of -cos
        low = (raw if excluded is None else raw.masked_fill(excluded, math.inf)).amin(-1)
        high = (raw if excluded is None else raw.masked_fill(excluded, -math.inf)).amax(-1)
        if image is not None:  # one min-max over every crop of an image (indices: the call's images)
            images = len(tokens.question.questions)
            low = low.new_full((images,), math.inf).scatter_reduce(0, image, low, "amin")[image]
            high = high.new_full((images,), -math.inf).scatter_reduce(0, image, high, "amax")[image]
        span = (high - low)[:, None]
        flat = span <= 0  # max = min: every token equally relevant
        r = ((raw - low[:, None] + 1e-6) / span.masked_fill(flat, 1.0)).masked_fill(flat, 1.0)
        return r if excluded is None else r.masked_fill(excluded, 0.0)

    def device_counts(self, sizes: torch.Tensor) -> torch.Tensor:
        """`keep_count` of every crop's valid token count [C] on the device (no host read)."""
        if isinstance(self.budget, int):
            counts = sizes.clamp(max=self.budget)
        else:
            counts = torch.minimum(torch.floor(sizes.double() * self.budget + 0.5).long().clamp(min=1), sizes)
        return torch.where(sizes > 0, counts, 0)

    def select(self, tokens: VisualTokens) -> Selection:
        projected = tokens.signals["projected"]
        device = projected.device
        crops, n = tokens.num_crops, tokens.num_tokens
        sizes = tokens.host_valid_counts()
        counts = [self.keep_count(s) if s else 0 for s in sizes]
        width = max(counts, default=0)
        uniform = len(set(counts)) <= 1
        # non_blocking: a host tensor's copy to the GPU is queued, never waited for (no host sync)
        valid = tokens.valid.to(device, non_blocking=True) if tokens.valid is not None else None
        order = torch.arange(n, device=device)
        if counts == sizes:  # every crop keeps all its valid tokens
            if valid is None:
                return Selection(kept=order[:width].expand(crops, -1))
            keep_all = order.masked_fill(~valid, n).sort(-1).values[:, :width]
            return Selection(kept=keep_all, counts=None if uniform else counts)
        excluded = None if valid is None else ~valid
        image = None if tokens.image_index is None else tokens.image_index.to(device, non_blocking=True)
        from ..kernels.dpp import dpp_greedy  # imports triton where installed: only when selecting

        with torch.no_grad():
            r = self.relevance_scores(tokens, excluded, image)
            quality = r if self.theta is None else torch.exp(self.theta / (2 * (1 - self.theta)) * r)
            if self.theta is not None and excluded is not None:
                quality = quality.masked_fill(excluded, 0.0)
            candidates = valid if valid is not None else torch.ones(crops, n, dtype=torch.bool, device=device)
            picks = dpp_greedy(F.normalize(projected.float(), dim=-1), quality, candidates, width, EXHAUSTED)
        if not uniform:  # crops keep different numbers: the picks past a crop's own count are not its
            limit = self.device_counts(candidates.sum(1))[:, None]
            picks = picks.masked_fill(order[:width] >= limit, -1)
        picked = torch.zeros(crops, n + 1, dtype=torch.bool, device=device)
        picked = picked.scatter(1, picks.masked_fill(picks < 0, n), True)[:, :n]
        # the greedy picks first, then (past the rank) the other candidates by relevance; stable: first index
        priority = r.masked_fill(picked, math.inf)
        priority = priority if excluded is None else priority.masked_fill(excluded, -math.inf)
        ranked = priority.argsort(dim=-1, descending=True, stable=True)[:, :width]
        if uniform:
            return Selection(kept=ranked.sort(-1).values)
        return Selection(kept=ranked.masked_fill(order[:width] >= limit, n).sort(-1).values, counts=counts)
