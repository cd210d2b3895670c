"""The adapter base class: everything about patching a model instance that is not family-specific.

An adapter installs two things on ONE model instance (never on a class):
- a wrapper around `model.generate` that encodes the images and selects tokens *before* calling the stock
  `generate` with the shorter prompt and the pre-encoded features (`mm_encoder_outputs`), so that generate's own
  beam/`num_return_sequences` expansion, attention-mask and position bookkeeping all see a consistent prompt; the
  original prompt is put back into the returned sequences, so callers that slice off the prompt keep working;
- a forward pre-hook doing the same for a plain `model(**inputs)` call.
`remove()` takes both away again; parameters, buffers and modules are never touched. What runs inside those calls
is in `calls.py` (`CallPath`, mixed in here); this file holds validation, install/remove and the family hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.kept import flat_kept, output_places  # noqa: F401 - used by the family adapters
from vtoken.geometry.tables import stack_padded
from vtoken.methods.base import Method
from vtoken.question import prompt_questions, tokenizer_for
from vtoken.records import LazyRecords, Record
from vtoken.stages.encoder import EncoderStage, SignalSources, check_signals, check_takes, keep_all
from vtoken.timing import Stopwatch
from vtoken.tokens import Selection, TextQuery, VisualTokens

from . import hf
from .calls import CallPath
from .frames import FrameLayout
from .llm import LanguageModelStages, QueryKeyProbe
from .prompt import PromptRuns, offset_tensors
from .sparse_prefill import SparseAttention
from .state import CallState, PatchedGenerate, PerThread


@dataclass(frozen=True)
class Modality:
    """One kind of visual input of a model family.

    name: its key in `mm_encoder_outputs` ("image" or "video"); pixel_key: the forward argument with its pixels;
    placeholder_attr: the config attribute holding its placeholder token id; encoder_kwargs: other forward
    arguments its encoder consumes (e.g. `image_sizes`, `image_grid_thw`); host: those of them the adapter needs
    as host integers (sizes that decide crop grids and counts), read once per call with the prompt's layout.
    """

    name: str
    pixel_key: str
    placeholder_attr: str
    encoder_kwargs: tuple[str, ...] = ()
    host: tuple[str, ...] = ()


@dataclass
class EncodedImages:
    """Result of the encoder stage for all images of a call.

    features: per image, [k_i, D] embeddings in the LLM's space, in the order the LLM receives them.
    keep_offsets: per image, sorted offsets (within its placeholder run) of the placeholders that remain, or an int
    n for its first n; None: every image keeps the first len(features[i]) of its run (renumbered positions: which
    ones does not matter).
    protected: per image, [k_i] bool over its remaining tokens: tokens no later stage may drop; None if none.
    companions: per image, further [k_i, D'] features that followed the same selection (e.g. Qwen3-VL's DeepStack
    levels), for `Adapter.encoder_output`; None if none.
    """

    features: list[torch.Tensor]
    keep_offsets: list[torch.Tensor | int] | None
    records: Sequence[Record]
    protected: list[torch.Tensor] | None = None
    companions: list[list[torch.Tensor]] | None = None


class Adapter(CallPath, FrameLayout):
    """Base class; one subclass per model family (one file each in `adapters/families/`)."""

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    model_classes: ClassVar[tuple[str, ...]] = ()
    modalities: ClassVar[tuple[Modality, ...]] = (Modality("image", "pixel_values", "image_token_id"),)
    # "renumber": kept tokens get contiguous positions; "original": they keep the positions they had
    positions: ClassVar[str] = "renumber"
    # per-token inputs besides input_ids/attention_mask/labels that shrink with the prompt, and their pad value
    token_columns: ClassVar[dict[str, int]] = {}
    # modalities whose `pooler_output` the model wants as one [num_items, tokens, D] tensor rather than a list
    stacked_features: ClassVar[frozenset[str]] = frozenset()

    layouts: ClassVar[tuple[str, ...]] = ("native",)
    # stages this family supports; "prefill"/"decode" need a 1-D RoPE decoder unless positions stay "original"
    stages: ClassVar[tuple[str, ...]] = ("encoder", "prefill", "decode", "sparse")
    # why a family lacks some of those stages, added to the refusal at `patch`
    stages_note: ClassVar[str] = ""
    multi_axis_positions: ClassVar[bool] = False
    # videos arrive as runs of image tiles, one per frame (InternVL): video-only methods find them in the prompt
    videos_as_image_runs: ClassVar[bool] = False
    # separator tokens closing every video's placeholder run (OneVision's newline): no frame's, so a decode-time
    # selection (DyCoke) does not choose among them
    video_run_trailer: ClassVar[int] = 0
    # the prompt's ids are needed on the host to tell its visual items apart (InternVL's "FrameN:" labels): read
    # once per call with the rest of its layout
    reads_prompt: ClassVar[bool] = False

    def __init__(self, model: nn.Module, methods: list[Method], layout: str = "native"):
        self.model = model
        self.methods = methods
        self.layout = layout
        self._hook = None
        self._post_hook = None
        self._ragged_hook = None
        self._llm_stages: LanguageModelStages | None = None
        self._calls = PerThread(CallState)  # per-call state, one per thread (hooks run in the calling thread)
        self._latest: list[Record] = []  # records of the most recent call of any thread
        self.installed = False
        self._own_generate = None  # an instance-level generate the model had before patch (restored by remove)
        encoder = self.encoder_method
        self.encoder = None if encoder is None else EncoderStage(encoder)  # the encoder stage every caller runs
        self.validate()

    # ----------------------------------------------------------------- per-call state
    @property
    def _state(self) -> CallState:
        """The calling thread's call state."""
        return self._calls.get()

    @property
    def records(self) -> list[Record]:
        """The records of the calling thread's most recent call (a thread that made none: the most recent call of
        any thread). A call leaves them unbuilt (`LazyRecords`): they are built on the first read."""
        state = self._state
        return list(state.records if state.called else self._latest)  # built now, if they were not yet

    @records.setter
    def records(self, value: Sequence[Record]) -> None:
        state = self._state
        state.records, state.called = value, True
        self._latest = value  # one reference swap: readers see either list, whole

    def add_records(self, more: Sequence[Record]) -> None:
        """Append `more` to the calling thread's records, both left unbuilt (a stage adding its records during the
        forward must not build the encoder's: building them may read the device)."""
        state = self._state
        self.records = LazyRecords.chain([state.records if state.called else self._latest, more])

    @property
    def _visual(self) -> torch.Tensor | None:
        """[B, L] visual tokens of this thread's current LLM input."""
        return self._state.visual

    @property
    def _protected(self) -> torch.Tensor | None:
        """[B, L] tokens of this thread's shrunk prompt that no LLM stage may drop."""
        return self._state.protected

    def __getstate__(self) -> dict[str, Any]:
        """For copy.deepcopy and pickling: a copy keeps the patch, not the calls made (records hold timers)."""
        state = dict(self.__dict__)
        state["_latest"] = []
        state.pop("_generate_signature", None)
        return state

    # ----------------------------------------------------------------- family-specific
    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return model_type in cls.model_types and type(model).__name__ in cls.model_classes

    def available_signals(self) -> set[str]:
        """Score signals this model can provide to methods, besides COMMON_SIGNALS."""
        return set()

    def refuse_resized_grids(self, what: str) -> None:
        """For families where only some inputs can take the smaller grid a method hands back (Fourier-VLM)."""
        if "resized_grid" in self.encoder_method.requires:
            raise InputError(
                f"{self.encoder_method.name} hands back smaller token grids, which {self.family} {what} cannot "
                "take (their crops are stitched and unpadded at full size); on this model it applies to videos, "
                "frame by frame"
            )

    def check_select_strategy(self, strategy: str | None) -> None:
        """Families whose features drop a [CLS] token: only `vision_feature_select_strategy="default"` (the call's,
        else the config's) is supported."""
        strategy = strategy or self.model.config.vision_feature_select_strategy
        if strategy != "default":
            raise InputError(
                f"vision_feature_select_strategy={strategy!r} is not supported by the {self.family} adapter; "
                "expected 'default' (patch tokens without [CLS])"
            )

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """[C, N, Dv] features of `VisualTokens` -> [C, N, D] in the LLM's embedding space (default: already)."""
        return features

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        """Placeholder count of every image (or video) before reduction; validates the input shapes."""
        raise NotImplementedError

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        """Per image, the placeholders that remain, when known before encoding (None: only after it)."""
        return [self.encoder_method.planned_count(n) for n in run_lengths]

    def planned_offsets(
        self, modality: Modality, run_lengths: list[int], planned: list[int]
    ) -> list[int | torch.Tensor] | None:
        """Per image, the placeholders that remain when only their count is known (renumbered positions): the first
        `planned[i]` ones (an int), unless an image's placeholders lie in several runs (see InternVL's videos; None:
        where they stay is known only after selecting)."""
        return list(planned)

    def on_host(self, name: str, value: Any) -> Any:
        """A call input the geometry needs as host integers (`Modality.host`, e.g. `image_sizes`), as lists: what
        this call read once with its prompt's layout (`read_call_layout`), else `value` read now."""
        known = self._state.host.get(name)
        if known is not None:
            return known
        return value.tolist() if isinstance(value, torch.Tensor) else value

    def encode(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> EncodedImages:
        """Run the vision side with the encoder-stage method and return what reaches the LLM."""
        raise NotImplementedError

    def select(self, tokens: VisualTokens) -> tuple[Selection, Stopwatch]:
        """The encoder stage on every crop of `tokens`, with this model's projector and the call's questions. A
        method acting on the placed tokens (DivPrune) selects later (`select_placed`): here every valid token is
        kept."""
        if self.encoder.placed:
            return keep_all(tokens), Stopwatch(tokens.features.device).start().stop()
        sources = SignalSources(self.project, lambda: TextQuery(self._state.questions, self.family, self.embed_text))
        return self.encoder.select(tokens, sources)

    def select_placed(self, modality: Modality, encoded: EncodedImages) -> EncodedImages:
        """The encoder method on every image's (video's) tokens as placed: `encoded` holds them all (see `select`);
        returns the kept ones, their placeholder offsets and companions, one record per image."""
        picks = self.encoder.select_placed(encoded.features)
        if picks is None:
            return encoded
        device, width = picks.flat.device, picks.width

        def take(items: list[torch.Tensor | int]) -> list[torch.Tensor]:  # an int n: an item's first n offsets
            return picks.take(stack_padded(offset_tensors(items, device), width))

        offsets = None if encoded.keep_offsets is None else take(encoded.keep_offsets)  # None: still the first ones
        protected = None if encoded.protected is None else take(encoded.protected)
        companions = None
        if encoded.companions is not None:
            levels = [take(list(level)) for level in zip(*encoded.companions, strict=True)]
            companions = [list(item) for item in zip(*levels, strict=True)] if levels else [[] for _ in picks.lengths]
        records = self.encoder.placed_records(picks, modality.name)
        return EncodedImages(picks.take(picks.padded), offsets, records, protected, companions)

    def encoder_output(self, encoded: EncodedImages, features: Any) -> Any:
        """Hook: what the stock forward receives in `mm_encoder_outputs` for one modality."""
        return hf.encoder_output(features)

    def before_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Hook: model kwargs of the unpruned prompt, e.g. to compute its own position ids first."""
        return kwargs

    def after_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Hook: model kwargs of the shrunk prompt before the stock forward/generate sees them."""
        return kwargs

    @property
    def inner(self) -> nn.Module:
        """The model under the LM head: vision tower(s), projector and language model."""
        return self.model.model if hasattr(self.model, "lm_head") else self.model

    def placeholder_id(self, modality: Modality) -> int:
        return getattr(self.model.config, modality.placeholder_attr)

    def present(self, kwargs: dict[str, Any]) -> list[Modality]:
        return [m for m in self.modalities if kwargs.get(m.pixel_key) is not None]

    @property
    def pad_token_id(self) -> int:
        config = self.model.config
        text = getattr(config, "text_config", config)
        pad = getattr(config, "pad_token_id", None)
        pad = getattr(text, "pad_token_id", None) if pad is None else pad
        return 0 if pad is None else pad

    # ----------------------------------------------------------------- validation
    @property
    def encoder_method(self) -> Method | None:
        found = [m for m in self.methods if "encoder" in m.stages]
        return found[0] if found else None

    @property
    def prefill_method(self) -> Method | None:
        found = [m for m in self.methods if "prefill" in m.stages]
        return found[0] if found else None

    @property
    def llm_method(self) -> Method | None:
        """The method acting inside the LLM (at the prefill or decode stage), which `LanguageModelStages` runs."""
        found = [m for m in self.methods if {"prefill", "decode"} & set(m.stages)]
        return found[0] if found else None

    @property
    def language_model(self) -> nn.Module:
        """The decoder stack (`.layers`, `.rotary_emb`) the LLM stages hook."""
        return self.inner.language_model

    def validate(self) -> None:
        if self.layout not in self.layouts:
            raise VTokenError(
                f"layout={self.layout!r} is not available for {type(self.model).__name__} ({self.family}); "
                f"it has: {', '.join(self.layouts)}"
            )
        for stage in ("encoder", "prefill", "decode", "sparse"):
            acting = [m.name for m in self.methods if stage in m.stages]
            if len(acting) > 1:
                raise VTokenError(
                    f"methods {', '.join(acting)} all act at the {stage} stage; combine at most one method per stage "
                    "(e.g. an encoder-stage method such as hired with a prefill-stage one such as fastv)"
                )
        inside = [m.name for m in self.methods if {"prefill", "decode"} & set(m.stages)]
        if len(inside) > 1:
            raise VTokenError(
                f"methods {', '.join(inside)} all act inside the LLM (prefill or decode stage); combine at most one "
                "of them, with an encoder-stage method if you like"
            )
        takes = {m.name for m in self.modalities} | ({"video"} if self.videos_as_image_runs else set())
        owner = f"{type(self.model).__name__} ({self.family})"
        for method in self.methods:
            check_takes(method, takes, f"the {self.family} adapter")
            unsupported = [s for s in method.stages if s not in self.stages]
            if unsupported:
                raise VTokenError(
                    f"method {method.name!r} acts at stage(s) {unsupported}, which the {self.family} adapter does "
                    f"not support; supported stages: {', '.join(self.stages)}"
                    + (f". {self.stages_note}" if self.stages_note else "")
                )
            check_signals(method, self.available_signals(), owner)
            if "question" in method.requires:
                self._tokenizer = tokenizer_for(self.model, method.name)  # fails at patch time, not at generate
        prefill = self.prefill_method
        if prefill is not None:
            if self.multi_axis_positions and prefill.positions == "renumber":
                fix = "use positions='original' (kept tokens keep their (t, h, w) positions)"
                if "positions" not in {f.name for f in fields(prefill)}:  # SparseVLM: renumbering is the method
                    fix = f"{prefill.name} always renumbers (its merged tokens have no position of their own)"
                raise VTokenError(
                    f"{prefill.name}: positions='renumber' is not defined for {self.family}'s multi-axis (M-RoPE) "
                    f"positions; {fix}"
                )
        llm = self.llm_method
        if llm is not None:
            layers = getattr(self.language_model, "layers", None)
            if layers is None or not hasattr(self.language_model, "rotary_emb"):
                raise VTokenError(f"{llm.name}: {type(self.language_model).__name__} has no decoder layers to hook")
            llm.drop_layers(len(layers))  # raises if the drop points do not fit this depth
            select = llm.select_layer(len(layers))  # (a decode-time selection's layer, likewise)
            if select is not None:  # its row comes from the layer before: softmax attention there
                read = layers[select - 1]
                if getattr(read, "self_attn", None) is None:
                    fits = [i + 1 for i, x in enumerate(layers[:-1]) if getattr(x, "self_attn", None) is not None]
                    raise VTokenError(
                        f"{llm.name}: layer={select} reads the attention row of layer {select - 1}, a "
                        f"{type(read).__name__} without softmax attention (linear attention in a hybrid LLM); "
                        f"layers that read one: {fits}"
                    )
                QueryKeyProbe.check(read.self_attn, f"{llm.name}: {type(read).__name__} {select - 1}")
        sparse = [m for m in self.methods if "sparse" in m.stages]
        self._sparse = SparseAttention(self, sparse[0]) if sparse else None  # checks the model, installs nothing

    # ----------------------------------------------------------------- the prompt's text
    _tokenizer = None

    def item_questions(self, kwargs: dict[str, Any], runs: PromptRuns, prompt: Any = None) -> list[str]:
        """The question of every image (or video) of a modality's `runs`: the text of its prompt row, or the
        method's explicit `question=` (one string, or one per row). `prompt`: the call's (input_ids, mask) as host
        lists when the call read them already (else read here, once)."""
        ids = kwargs["input_ids"]
        given = getattr(self.encoder_method, "question", None)
        if given is None:
            ids, mask = prompt if prompt is not None else (ids, kwargs.get("attention_mask"))
            per_row = prompt_questions(ids, mask, self._tokenizer)
        elif isinstance(given, str):
            per_row = [given] * ids.shape[0]
        elif len(given) == ids.shape[0]:
            per_row = list(given)
        else:
            raise InputError(f"{self.encoder_method.name}: {len(given)} questions given for {ids.shape[0]} prompts")
        return [per_row[row] for row in runs.rows]

    def embed_text(self, text: str) -> torch.Tensor:
        """[T, D] LLM input embeddings of `text`, tokenized without special tokens (by the tokenizer `validate`
        resolved for methods that require "question")."""
        embeddings = self.model.get_input_embeddings()
        ids = self._tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        return embeddings(ids.to(embeddings.weight.device))

    # ----------------------------------------------------------------- install / remove
    # Every hook is a bound method of a picklable object: a patched model deep-copies (the copy's hooks are bound
    # to the copy's adapter) and pickles.
    def _join_ragged(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """A modality whose forward wants one [items, tokens, D] tensor, when its items kept different numbers of
        tokens (VidCom2's videos): `prepare` hands generate a list (its beam expansion splits lists by placeholder
        counts), and the forward gets all items as one [1, total, D] item, which fills the placeholders alike."""
        outputs = kwargs.get("mm_encoder_outputs") or {}
        joined = {}
        for name in self.stacked_features:
            out = outputs.get(name)
            if out is not None and isinstance(out.pooler_output, list):
                joined[name] = type(out)(**{**out, "pooler_output": torch.cat(out.pooler_output)[None]})
        return (args, dict(kwargs, mm_encoder_outputs={**outputs, **joined})) if joined else None

    def install(self) -> None:
        model = self.model
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        if self.stacked_features:
            self._ragged_hook = self.inner.register_forward_pre_hook(self._join_ragged, with_kwargs=True)
        if self.llm_method is not None:
            self._llm_stages = LanguageModelStages(self, self.llm_method)
            self._llm_stages.install()
        self._post_hook = model.register_forward_hook(self._post_forward)
        self.installed = True
        if hasattr(model, "generate"):
            self._own_generate = model.__dict__.get("generate")
            model.generate = PatchedGenerate(self)
        if self._sparse is not None:
            self._sparse.install()

    def remove(self) -> None:
        if getattr(self, "_sparse", None) is not None:
            self._sparse.remove()
        self.installed = False
        for name in ("_hook", "_post_hook", "_ragged_hook"):
            if getattr(self, name) is not None:
                getattr(self, name).remove()
                setattr(self, name, None)
        if self._llm_stages is not None:
            self._llm_stages.remove()
            self._llm_stages = None
        generate = self.model.__dict__.get("generate")
        if isinstance(generate, PatchedGenerate) and generate.adapter is self:  # not one the user set since
            if self._own_generate is None:
                del self.model.__dict__["generate"]
            else:
                self.model.__dict__["generate"] = self._own_generate

    @property
    def stock_generate(self) -> Any:
        """The generate the model had before patch: the user's own instance-level one, else the class's."""
        if self._own_generate is not None:
            return self._own_generate
        return type(self.model).generate.__get__(self.model)
