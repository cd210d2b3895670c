"""The adapter base class: one model family's knowledge, and the stage objects one patch is made of.

An adapter (one subclass per family, in `families/`) is the only code that knows a model's internals: its
geometry (placeholder counts, crop grids, positions), its towers and signals, and how its encoder output reaches the
LLM. It holds, as collaborators with one job each:
- `tower_stage` and `tower_site`: the tower stage (`vtoken.stages.tower.TowerStage`, what every caller shares of a
  method acting before or inside the vision tower) and where it meets this model (`tower.TowerSite`: ToMe's
  merging blocks, the plan each call makes before its tower runs), when a tower method is given;
- `encoder`: the encoder stage (`vtoken.stages.encoder.EncoderStage`, the same object the vLLM plugin and
  `vtoken.select` run; after a tower method alone, `KeepAll`: every token the tower left);
- `calls`: the call path (`calls.py`), whose forward pre-hook and generate wrapper encode the images and select
  tokens *before* the stock `generate` runs on the shorter prompt with the pre-encoded features
  (`mm_encoder_outputs`), so that generate's own beam/`num_return_sequences` expansion, masks and positions see a
  consistent prompt, and the caller's prompt is put back into the returned sequences;
- `llm` and `sparse`: the LLM stages (`llm/`) and sparse prefill (`sparse_prefill.py`), when a method acts there;
- `hooks`: the one owner of everything installed on ONE model instance (never a class), which `remove()` takes
  away again; parameters, buffers and modules are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.kept import flat_kept, output_places  # noqa: F401 - used by the family adapters
from vtoken.geometry.tables import on_device, stack_padded
from vtoken.methods.base import Method, TowerMethod
from vtoken.question import prompt_questions, tokenizer_for
from vtoken.records import Record
from vtoken.stages.encoder import EncoderStage, SignalSources, check_signals, check_takes, keep_all
from vtoken.stages.tower import OUTPUT_SIGNALS, KeepAll, TowerStage
from vtoken.timing import Stopwatch
from vtoken.tokens import Selection, TextQuery, VisualTokens

from . import frames, hf
from .calls import CallPath
from .hooks import HookOwner
from .llm import LanguageModelStages, QueryKeyProbe
from .prompt import PromptRuns, offset_tensors
from .sparse_prefill import SparseAttention
from .state import CallState, PatchedGenerate
from .tower import TowerPlan, TowerSite, tower_shape


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
    groups: per image, [k_i] int64 each remaining token's group within its image (0.., -1: none), from a selection's
    `groups` (PruneVid's windows and frames), and group_sizes: per image, the size of each of its groups (host);
    None if the selection has none.
    """

    features: list[torch.Tensor]
    keep_offsets: list[torch.Tensor | int] | None
    records: Sequence[Record]
    protected: list[torch.Tensor] | None = None
    companions: list[list[torch.Tensor]] | None = None
    groups: list[torch.Tensor] | None = None
    group_sizes: list[list[int]] | None = None


class Adapter:
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
    # every frame (temporal unit) of a video is its own placeholder run, with text between runs (Qwen3-VL)
    frame_runs: ClassVar[bool] = False
    # how tower methods (the "tower" stage) act in this family's tower, as this adapter wires them: "input" (rows
    # dropped before block 0: PixelPrune), "layers" (merges inside the blocks: ToMe); none: no tower stage
    tower_acts: ClassVar[tuple[str, ...]] = ()
    # why tower methods are not wired here (added to the refusal at `patch`)
    tower_note: ClassVar[str] = ""
    # modality -> why tower methods do not act on it in this family (added to the refusal when a call passes it)
    tower_refusals: ClassVar[dict[str, str]] = {}
    # tokens at the start of every video frame that are not patches (Video-LLaVA's [CLS]): no place in the frame
    frame_leading: ClassVar[int] = 0

    def __init__(self, model: nn.Module, methods: list[Method], layout: str = "native"):
        self.model = model
        self.methods = methods
        self.layout = layout
        # a tower method without an encoder method: every token the tower left goes on (records: the tower's)
        alone = self.tower_method is not None and not any("encoder" in m.stages for m in methods)
        self._keep_all = KeepAll() if alone else None
        encoder = self.encoder_method
        self.encoder = None if encoder is None else EncoderStage(encoder)  # the encoder stage every caller runs
        self.tower_stage: TowerStage | None = None  # made by `validate` (it reads the tower), with its site
        self.tower_site: TowerSite | None = None
        self.calls = CallPath(self)
        self.hooks = HookOwner(model)
        self.llm: LanguageModelStages | None = None  # made and checked here, installed with the rest
        self.sparse: SparseAttention | None = None  # made by `validate` (it checks the model), installed with the rest
        self.validate()
        if self.llm_method is not None:  # after the family's own checks: every layer it acts on or reads
            self.llm = LanguageModelStages(self, self.llm_method)
            self.llm.check()  # installs nothing

    # ----------------------------------------------------------------- what the call path keeps
    @property
    def _state(self) -> CallState:
        """The calling thread's call state (kept by the call path)."""
        return self.calls.state

    @property
    def records(self) -> list[Record]:
        """The records of the calling thread's most recent call (`CallPath.records`)."""
        return self.calls.records

    def add_records(self, more: Sequence[Record]) -> None:
        """Append a stage's records to the calling thread's, unbuilt (`CallPath.add_records`)."""
        self.calls.add_records(more)

    def visual_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        return self.calls.visual_mask_for(shape)

    def protected_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        return self.calls.protected_mask_for(shape)

    def groups_for(self, shape: tuple[int, int]) -> tuple[torch.Tensor, list[list[int]]] | None:
        return self.calls.groups_for(shape)

    def layout_for(self, shape: tuple[int, int]) -> Any:
        return self.calls.layout_for(shape)

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
        """Per image, the placeholders that remain, when known before encoding (None: only after it). After a tower
        method, the encoder method's count of the tokens the tower leaves (one crop per image here)."""
        plan = self.tower_plan(modality)
        lengths = run_lengths if plan is None else plan.item_counts()
        return [self.encoder_method.planned_count(n) for n in lengths]

    def planned_offsets(
        self, modality: Modality, run_lengths: list[int], planned: list[int]
    ) -> list[int | torch.Tensor] | None:
        """Per image, the placeholders that remain when only their count is known: with renumbered positions the
        first `planned[i]` ones (an int), unless an image's placeholders lie in several runs (see InternVL's
        videos); None: where they stay is known only after selecting (original positions, unless a family knows
        them before: Qwen after PixelPrune alone)."""
        return list(planned) if self.positions == "renumber" else None

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

    def continued_positions(
        self, mask: torch.Tensor, past: int, tail_positions: torch.Tensor | None, offset: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, past + n] positions decoding gives a conversation whose cache holds `past` tokens, then n new ones:
        one per real token of `mask` (1-D RoPE). Families with multi-axis positions override this (the new tokens'
        own visual positions, `tail_positions`, start where decoding would continue)."""
        return (mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(mask == 0, 0)

    def position_offset(self, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """[B] what decoding adds to a new token's position counted over real tokens, after the prompt in `kwargs`
        (None: nothing, 1-D RoPE)."""
        return None

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
        """The encoder-stage method; after a tower method alone, `KeepAll` (every token the tower left)."""
        found = [m for m in self.methods if "encoder" in m.stages]
        return found[0] if found else self._keep_all

    @property
    def tower_alone(self) -> bool:
        """A tower method without an encoder method: the tokens leaving the tower reach the LLM (`KeepAll`)."""
        return self._keep_all is not None

    @property
    def tower_method(self) -> TowerMethod | None:
        """The method acting before or inside the vision tower (the "tower" stage), if any."""
        found = [m for m in self.methods if "tower" in m.stages]
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
        for stage in ("tower", "encoder", "prefill", "decode", "sparse"):
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
        stages = (("tower",) if self.tower_acts else ()) + tuple(self.stages)
        for method in self.methods:
            if "tower" in method.stages:  # the method's own refusals (the spec's reasons) first
                TowerStage.check_family(method, self.family)
            check_takes(method, takes, f"the {self.family} adapter")
            unsupported = [s for s in method.stages if s not in stages]
            if unsupported:
                note = self.tower_note if unsupported == ["tower"] else self.stages_note
                raise VTokenError(
                    f"method {method.name!r} acts at stage(s) {unsupported}, which the {self.family} adapter does "
                    f"not support; supported stages: {', '.join(stages)}" + (f". {note}" if note else "")
                )
            if "tower" in method.stages and method.acts not in self.tower_acts:
                raise VTokenError(
                    f"{method.name} acts {'inside the blocks' if method.acts == 'layers' else 'on the input rows'} "
                    f"of the vision tower, which the {self.family} adapter does not wire yet; it wires tower methods "
                    f"acting on: {', '.join(self.tower_acts)}"
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
        self.sparse = SparseAttention(self, sparse[0]) if sparse else None  # checks the model, installs nothing
        tower = self.tower_method
        if tower is not None:  # reads the tower (and checks ToMe's blocks): nothing installed yet
            self.tower_stage = TowerStage(tower, tower_shape(self.model, self.family))
            self.tower_stage.check_encoder(self.encoder_method, self.tower_signals(), owner)
            self.tower_site = TowerSite(self.tower_stage, self.merging_tower if tower.acts == "layers" else None)

    # ----------------------------------------------------------------- the tower stage
    @property
    def merging_tower(self) -> nn.Module:
        """The CLIP / SigLIP tower (`encoder.layers`) a tower method acting in the blocks (ToMe) merges in."""
        return self.tower

    def tower_signals(self) -> set[str]:
        """The signals this family serves an encoder method on the tower's output after the tower method: those
        of the output tokens themselves. ("grid" is not among them: after PixelPrune the crop's grid has holes, not
        the rectangle of valid tokens a grid method assumes; after ToMe there is none.)"""
        return self.available_signals() & set(OUTPUT_SIGNALS)

    def plan_tower(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> TowerPlan | None:
        """Hook: the tower stage's plan of this call's `modality`, before the prompt is shrunk and the tower runs
        (tokens leaving the tower; PixelPrune's kept units). Called after `plan` checked the inputs."""
        raise NotImplementedError(f"{self.family} declares tower_acts but plans no tower call")

    def tower_plan(self, modality: Modality) -> TowerPlan | None:
        """The calling thread's tower plan of `modality` in the running call (None: no tower stage for it)."""
        return self._state.tower.get(modality)

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
        ids = self._tokenizer(text, add_special_tokens=False).input_ids  # host ints: no tensor made from host data
        # one non-blocking copy from pinned memory on a GPU (a pageable copy would wait for the device's queue)
        return embeddings(on_device(ids, embeddings.weight.device))

    # ----------------------------------------------------------------- install / remove
    # Every hook is a bound method of a picklable object: a patched model deep-copies (the copy's hooks are bound
    # to the copy's adapter) and pickles.
    def install(self) -> None:
        hooks, model = self.hooks, self.model
        hooks.before_forward(model, self.calls.pre_forward)
        if self.stacked_features:
            hooks.before_forward(self.inner, self.calls.join_ragged)
        if self.llm is not None:
            self.llm.install(hooks)
        hooks.after_forward(model, self.calls.post_forward)
        hooks.wrap_generate(PatchedGenerate(self))
        if self.sparse is not None:
            self.sparse.install(hooks)
        if self.tower_site is not None:
            self.tower_site.install(hooks)
        hooks.installed = True

    def remove(self) -> None:
        self.hooks.remove()
        self.llm = None

    @property
    def installed(self) -> bool:
        return self.hooks.installed

    @property
    def stock_generate(self) -> Any:
        """The generate the model had before patch: the user's own instance-level one, else the class's."""
        return self.hooks.stock_generate

    # ----------------------------------------------------------------- where a prompt's video frames sit
    @property
    def takes_video(self) -> bool:
        """A video modality of its own, or videos as labelled image runs (`videos_as_image_runs`: InternVL)."""
        return any(m.name == "video" for m in self.modalities) or self.videos_as_image_runs

    def check_frame_layout(self) -> None:
        """Raise a VTokenError when this model's frames cannot be found in its prompts (see InternVL)."""

    def video_frames(self, kwargs: dict[str, Any]) -> list[int] | None:
        """Frames (temporal units) of every video of a call's inputs, in order; None: no video."""
        return frames.video_frames(kwargs)

    def frame_spans(self, input_ids: torch.Tensor, counts: list[int] | None) -> list[list[torch.Tensor]] | None:
        """Per row of `input_ids` [B, L], per video, [F, 2] (start, end) columns of its frames; None when the
        prompt's video runs do not match `counts` (the call's videos' frames, in order)."""
        video = next((m for m in self.modalities if m.name == "video"), None)
        if not counts or video is None:
            return None
        return frames.frame_spans(input_ids == self.placeholder_id(video), counts, self.frame_runs)

    def frame_read(self, input_ids: torch.Tensor, counts: list[int] | None) -> torch.Tensor | None:
        """[B, K] int64 on the prompt's device, made without a sync: what `frame_columns` needs of `input_ids` [B, L]
        on the host, read with the call's layout (`CallPath.note_layout`); None: no video to find. Here every row's
        video placeholder runs (`frames.run_edges`), as many as the call's videos make (`counts`: their frames)."""
        video = next((m for m in self.modalities if m.name == "video"), None)
        if not counts or video is None:
            return None
        width = sum(counts) if self.frame_runs else len(counts)  # the runs the call's videos make, batch-wide
        return frames.run_edges(input_ids == self.placeholder_id(video), width)

    def frame_columns(self, rows: list[list[int]], counts: list[int] | None) -> frames.Columns | None:
        """Per row, per video, the (start, end) columns of its frames, on the host, from the rows of `frame_read`
        read to the host; None when the prompt's video runs do not match `counts` (as `frame_spans`)."""
        runs = frames.runs_of_edges(rows) if counts else None
        return None if runs is None else frames.frame_columns(runs, len(rows), counts, self.frame_runs)
