"""The cases of the contract table (tests/test_contract.py): every registered method x every tiny family x every
input the family takes, where the method applies, all derived from the registry (`vtoken.available_methods`,
`Method.declared_params`, `fit`, `demo_params`), `vtoken.model_view`, `vtoken.applicable_methods` /
`applicable_layouts` and docs/guide/methods.md's family tables; plus the inputs, settings and snapshots the rows
compare. Nothing here lists methods or families by hand; the few facts a declaration does not carry (how a method
keeps every token where its budget parameter alone does not) are keyed by method, each with its reason, and the
table fails on a stale key.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

import vtoken
from vtoken.applicability import applicable_layouts, applicable_methods
from vtoken.images import example_clip
from vtoken.methods.base import EncoderMethod, Method
from vtoken.params import Choice, Fractions, Int, Kept, Layers, OrNone, Param, Real, Texts, own
from vtoken.registry import make_method, method_class
from vtoken.zoo import TINY_MODELS, build_prompt

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOCS_PAGES = (DOCS / "guide" / "methods.md", *sorted(DOCS.glob("methods-*.md")))  # the method x family tables
FAMILIES = tuple(TINY_MODELS)
METHODS = tuple(vtoken.available_methods())
MODALITIES = ("image", "video")
PRUNING_BUDGET = 0.1  # a pruning run's budget parameter: few tokens keep the greedy methods (MMTok, CDPruner) short

# How a method keeps every token beyond its budget parameters at 1.0 (a `Kept` parameter, every entry of a
# `Fractions` one), where it has such a setting (DESIGN.md's invariant 1 holds there)
KEEP_ALL: dict[str, dict[str, Any]] = {
    "dycoke": {"k": 0.0, "p": 0.0},  # no frame pruned, no decoding step restricted
    "holitom": {"tau": 1.0},  # nothing static: every (dynamic) token kept
    "fastvid": {"d": 0.0},  # every kept token salient, nothing merged
    "mustdrop": {"merge_threshold": 1.01, "individual_thr": 0.0},  # no window merges, the prefill filter drops none
    "sparse_prefill": {"density": 1.0},  # every causal block computed (its sparse path, not the model's own)
    "pixelprune": {"threshold": -1.0},  # every unit differs from its prediction by more than a negative threshold
    "tome": {"r": 0},  # no merge in any block
    # nothing static, every group passes unclustered (cluster_ratio=1.0 keeps every token too, but emits a group's
    # centres in density order, the official order: not the unpatched sequence), no cut
    "prunevid": {"tau": 1.0, "min_tokens": 1 << 20, "layer": None},
    "framefusion": {"threshold": 1.0, "cost": 1.0},  # no pair similar enough to merge, no prune
}
# settings a pruning run adds to the demo's, to keep the table fast on CPU
PRUNING: dict[str, dict[str, Any]] = {
    "sparse_prefill": {"backend": "torch"},  # "auto" picks flex attention for a padded batch on CPU, uncompiled
}
# methods with no setting that keeps every token
NO_KEEP_ALL: dict[str, str] = {
    "sparsevlm": "always drops one token per layer (its official counts; a count of all is refused)",
    "vidcom2": "frames less unique than the video's average lose tokens even at a budget of 1",
}


@functools.cache
def tiny(family: str):
    """(model, processor) of a tiny family, built once per session."""
    return TINY_MODELS[family]()


@functools.cache
def view(family: str):
    return vtoken.model_view(tiny(family)[0])


@functools.cache
def verdicts(family: str) -> dict[str, str | None]:
    return applicable_methods(tiny(family)[0])


def takes(family: str) -> tuple[str, ...]:
    """The inputs a family's processor takes: images, and videos where it has a video processor (as the CLI asks)."""
    return ("image", "video") if getattr(tiny(family)[1], "video_processor", None) is not None else ("image",)


# --------------------------------------------------------------------------- docs/guide/methods.md's family tables
def _key(text: str) -> str:
    return re.sub(r"[\s_-]", "", text.lower())


def _docs_family(header: str, families: set[str]) -> list[str]:
    """The adapter families a table header names ("Qwen2-VL / Qwen2.5-VL", "FastVLM (timm FastViTHD)"): each part
    matched to the family whose name it starts with (the longest such)."""
    out = []
    for part in re.sub(r"\(.*?\)", "", header).split("/"):
        matches = [f for f in families if _key(part).startswith(_key(f))]
        if matches:
            out.append(max(matches, key=len))
    return out


@functools.cache
def docs_cells() -> dict[tuple[str, str], list[str]]:
    """(method, adapter family) -> its cells in the docs' method x family tables (docs/guide/methods.md's, both
    orientations, and the method pages' "family | `method` ..." tables)."""
    families = {view(f).family for f in FAMILIES}
    cells: dict[tuple[str, str], list[str]] = {}
    for page in DOCS_PAGES:
        header: list[str] = []
        for line in page.read_text().splitlines():
            if not line.startswith("|"):
                header = []
                continue
            parts = [p.strip() for p in line.strip().strip("|").split("|")]
            if not header:
                header = parts if parts[0] in ("method \\ family", "family \\ method", "family") else ["-"]
                continue
            if header == ["-"] or set(parts[0]) <= {"-"}:
                continue
            for column, cell in zip(header[1:], parts[1:], strict=True):
                method_text, family_text = (parts[0], column) if header[0].startswith("method") else (column, parts[0])
                for name in re.findall(r"`([a-z0-9_]+)`", method_text.split("(")[0]):
                    for family in _docs_family(family_text, families):
                        cells.setdefault((name, family), []).append(cell)
    return cells


def docs_refuses(method: str, family: str) -> bool | None:
    """Whether the docs' cells for (method, family) say "n/a" (None: no cell; a ValueError where they disagree)."""
    says = {cell.startswith("n/a") for cell in docs_cells().get((method, view(family).family), [])}
    if len(says) > 1:
        raise ValueError(f"the docs' tables disagree on {method} for {view(family).family}")
    return says.pop() if says else None


def docs_refused_inputs(method: str, family: str) -> set[str]:
    """Inputs the docs' cells refuse at the call where the method otherwise applies ("images n/a (anyres)")."""
    cells = " ".join(docs_cells().get((method, view(family).family), []))
    return {m for m, word in (("image", "images"), ("video", "videos")) if re.search(rf"\b{word}:? n/a", cells)}


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One method on one tiny family, with one kind of input, in one layout."""

    method: str
    family: str
    modality: str
    layout: str = "native"

    def __str__(self) -> str:
        return "-".join([self.method, self.family, self.modality] + ([self.layout] if self.layout != "native" else []))


def fitted(case_or_family, method: str | None = None) -> dict[str, Any]:
    """The method's demo settings (what shows it acting on a short prompt) and the parameters that fit the family."""
    family = case_or_family.family if isinstance(case_or_family, Case) else case_or_family
    name = case_or_family.method if isinstance(case_or_family, Case) else method
    cls = method_class(name)
    return {**cls.demo_params, **cls.fit(view(family))}


def refused_at_call(method: str, family: str, modality: str) -> bool:
    """An input the patched model refuses when the call starts: one the method does not act on, or one the docs
    mark n/a for this family."""
    return modality not in method_class(method).modalities or modality in docs_refused_inputs(method, family)


@functools.cache
def all_cases() -> tuple[Case, ...]:
    """Every (method, family, input, layout) where `applicable_methods` says the method applies and the call is
    not refused: each layout `applicable_layouts` gives."""
    out = []
    for family in FAMILIES:
        model = tiny(family)[0]
        for method, why in verdicts(family).items():
            if why is not None or method not in METHODS:
                continue
            layouts = applicable_layouts(model, method, **fitted(family, method))
            for modality in takes(family):
                if not refused_at_call(method, family, modality):
                    out += [Case(method, family, modality, layout) for layout in layouts]
    return tuple(out)


def native_cases() -> list[Case]:
    """The cases in the model's own packing (where keeping everything is the unpatched model)."""
    return [c for c in all_cases() if c.layout == "native"]


def refused_call_cases() -> list[Case]:
    """Inputs a family takes that an applicable method refuses at the call."""
    return [
        Case(method, family, modality, applicable_layouts(tiny(family)[0], method, **fitted(family, method))[0])
        for family in FAMILIES
        for method, why in verdicts(family).items()
        if why is None
        for modality in takes(family)
        if refused_at_call(method, family, modality)
    ]


def refused_patch_cases() -> list[tuple[str, str]]:
    return [(m, f) for f in FAMILIES for m, why in verdicts(f).items() if why is not None and m in METHODS]


# --------------------------------------------------------------------------- method settings
def pruning(case: Case) -> Method:
    """The method as a pruning run uses it: its demo settings fitted to the family, the budget parameter (where it
    takes a fraction) at PRUNING_BUDGET."""
    cls = method_class(case.method)
    params = {**fitted(case), **PRUNING.get(case.method, {})}
    spec = cls.declared_params().get(cls.budget_param) if cls.budget_param else None
    if spec is not None and isinstance(own(spec), Kept):
        params[cls.budget_param] = PRUNING_BUDGET
    return make_method(case.method, **params)


def keep_all(case: Case) -> Method:
    """The method set to keep every token: `pruning`'s settings with every budget parameter at 1.0 (the budget
    parameter, a `Kept` parameter set by default, each entry of a `Fractions` one) and KEEP_ALL's settings."""
    cls = method_class(case.method)
    params = {**cls.defaults(), **fitted(case)}
    out = {}
    for param, spec in cls.declared_params().items():
        if isinstance(own(spec), Kept) and (param == cls.budget_param or params.get(param) is not None):
            out[param] = 1.0
        elif isinstance(own(spec), Fractions) and params.get(param) is not None:
            out[param] = (1.0,) * len(params[param])
    return make_method(case.method, **{**fitted(case), **out, **KEEP_ALL.get(case.method, {})})


def expected_count(method: Method, n: int) -> int | None:
    """Tokens an encoder stage keeps of a crop of n, where its declaration says: the count it plans before the data
    (`planned_count`), else a crop-scope selection's `keep_count` (it picks among the crop's tokens, merges none)."""
    if not isinstance(method, EncoderMethod):
        return None
    planned = method.planned_count(n)
    if planned is None and method.scope == "crop" and not method.merges:
        return method.keep_count(n)
    return planned


def keeps_a_count(case: Case) -> bool:
    return expected_count(pruning(case), 576) is not None


# --------------------------------------------------------------------------- inputs
def image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# two rows: the case's own input, and a second of another shape (more crops on anyres families) with a longer
# question; the batch row pads them
ROWS = (
    {"image": (224, 224, 0), "clip": (4, 112), "question": "what is in the image?"},
    {"image": (280, 140, 1), "clip": (4, 96), "question": "describe what you see in detail, please."},
)


def inputs(family: str, modality: str, rows: tuple[int, ...] = (0,)):
    """Processor inputs of `rows` of ROWS (left-padded), one image or one clip each. PerceptionLM's processor tiles
    a batch's images to one tile count (a row's prompt then differs from the row alone, even unpatched): there
    every row takes the first row's size. Where a processor cannot stack the rows' images, likewise."""
    processor = tiny(family)[1]
    texts = [build_prompt(processor, ROWS[r]["question"], *((1, 0) if modality == "image" else (0, 1))) for r in rows]
    if modality == "video":
        extra = {"do_sample_frames": False} if getattr(processor.video_processor, "do_sample_frames", False) else {}
        clips = [example_clip(*ROWS[r]["clip"]) for r in rows]
        return processor(text=texts, videos=clips, return_tensors="pt", padding=True, **extra)
    images = [image(*ROWS[r]["image"]) for r in rows]
    if type(processor).__name__ == "PerceptionLMProcessor":
        width, height, _ = ROWS[0]["image"]
        images = [image(width, height, ROWS[r]["image"][2]) for r in rows]
    nest = type(processor).__name__ == "Gemma3Processor"  # one list of images per prompt
    try:
        return processor(text=texts, images=[[i] for i in images] if nest else images, return_tensors="pt",
                         padding=True)  # fmt: skip
    except ValueError:
        if len(rows) == 1:
            raise
        width, height, _ = ROWS[rows[0]]["image"]
        images = [image(width, height, ROWS[r]["image"][2]) for r in rows]
        return processor(text=texts, images=images, return_tensors="pt", padding=True)


def greedy(model, batch, steps: int = 3):
    """Greedy generation keeping its per-step logits: (ids [B, steps], logits [steps, B, V])."""
    out = model.generate(**batch, max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    return out.sequences[:, batch["input_ids"].shape[1] :], torch.stack(out.logits)


@dataclass
class Reference:
    """The unpatched model on a family's first row: logits and greedy generation."""

    logits: torch.Tensor
    greedy: tuple[torch.Tensor, torch.Tensor]


@functools.cache
def reference(family: str, modality: str) -> Reference:
    model = tiny(family)[0]
    batch = inputs(family, modality)
    with torch.no_grad():
        return Reference(model(**batch).logits, greedy(model, batch))


# --------------------------------------------------------------------------- what "intact" means
def snapshot(model) -> dict:
    """Everything `patch` may touch: tensors, modules (their class, instance attributes and the class's forward:
    a wrapped forward or a class patched process-wide shows), hooks, attention implementations, the model's own
    attributes (a generate wrapper, the handle)."""
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": [(n, type(m), sorted(vars(m)), type(m).forward) for n, m in model.named_modules()],
        "hooks": [
            (
                n,
                dict(m._forward_pre_hooks),
                dict(m._forward_hooks),
                set(m._forward_pre_hooks_with_kwargs),
                set(m._forward_hooks_with_kwargs),
            )
            for n, m in model.named_modules()
        ],  # fmt: skip
        "attention": [(n, m.config._attn_implementation) for n, m in model.named_modules() if hasattr(m, "config")],
        "model": (sorted(vars(model)), type(model).generate, vtoken.handle_of(model)),
        "generation": model.generation_config.to_dict(),
    }


def assert_same_snapshot(after: dict, before: dict) -> None:
    for key in ("modules", "hooks", "attention", "model", "generation"):
        assert after[key] == before[key], key
    assert after["tensors"].keys() == before["tensors"].keys()
    changed = [k for k, v in before["tensors"].items() if not torch.equal(after["tensors"][k], v)]
    assert not changed, changed


# --------------------------------------------------------------------------- parameter checks
BUILT_IN_SPECS = (Kept, Int, Real, Choice, Layers, Texts)  # declarations whose accepted values vtoken.params defines


def bad_values(spec: Param) -> list:
    """Values a parameter declared as `spec` must refuse, from its declaration alone: one of no accepted type, and
    for vtoken.params' own declarations the values just outside what they accept (None where it is not optional)."""
    inner = own(spec)
    values: list = [object()]
    if isinstance(inner, Kept):
        values += [0, 1.5, -0.2, True, "half", float("nan"), float("inf"), [0.5]] + ([1] if not inner.counts else [])
    elif isinstance(inner, Int):
        values += [True, 2.5, "3"]
        values += [inner.minimum - 1] if inner.minimum is not None else []
        values += [inner.maximum + 1] if inner.maximum is not None else []
    elif isinstance(inner, Real):
        low, high = inner.bounds
        values += [float("nan"), True, "0.5"]
        values += [low - 1 if inner.interval[0] == "[" else low] if math.isfinite(low) else []
        values += [high + 1 if inner.interval[-1] == "]" else high] if math.isfinite(high) else [float("inf")]
    elif isinstance(inner, Choice):
        values += ["no-such-choice"] + ([] if any(o is True for o in inner.options) else [True])  # a Flag takes True
    elif isinstance(inner, Layers):
        values += [(), (2, 1), (-1,), (True, 3), (2.0, 3), "2"]
    elif isinstance(inner, Texts):
        values += ["", [], ["a?", 3]]
    if isinstance(inner, BUILT_IN_SPECS) and not isinstance(spec, OrNone):
        values.append(None)
    return values


def accepted_words(method: str, spec: Param) -> list[str]:
    """What a refusal of a value for a parameter declared as `spec` says is accepted."""
    inner = own(spec)
    if isinstance(inner, Kept):
        return ["(0, 1]"]
    if isinstance(inner, Real):
        return [inner.interval] if all(map(math.isfinite, inner.bounds)) else ["number"]
    if isinstance(inner, Int):
        return ["an int"]
    if isinstance(inner, Choice):
        return [str(option) for option in inner.choices(method_class(method))]
    if isinstance(inner, Layers):
        return ["layer indices"]
    if isinstance(inner, Texts):
        return ["string"]
    return []


def parameter_cases() -> list[tuple[str, str, Any]]:
    """(method, parameter, bad value) for every declared parameter of every method."""
    return [
        (name, param, value)
        for name in METHODS
        for param, spec in method_class(name).declared_params().items()
        for value in bad_values(spec)
    ]


def every_param_is_declared(cls: type[Method]) -> bool:
    return set(cls.declared_params()) == set(cls.defaults())
