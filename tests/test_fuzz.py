"""Property-based fuzzing of the public API over every built-in family (issue 16): image sizes and aspect ratios,
frame counts, images per prompt, budgets (fractions and counts), scopes, layouts, batch compositions, padding
sides, methods and stage combinations (an encoder method + FastV).

Properties: budgets are exact (records against `vtoken.tokens_to_keep` or the method's published formula, and the
LLM's input shrinks by exactly the dropped tokens), keeping everything is the unpatched model (<= 1e-5), a padded
batch equals its rows run one by one, `unpatch` restores parameters, hooks and outputs exactly, and whatever goes
wrong is a `vtoken.VTokenError`, raised at `patch` exactly where the tables of docs/guide/methods.md say "n/a".

Decisions across code paths (docs/versions.md, "the tolerance policy"): a padded batch's logits equal its rows'
within 1e-4 at the last real token (no greedy ids are compared here), and its records equal theirs exactly: an
encoder method selects one crop at a time on features that the towers compute bit for bit the same in a batch and
alone (AVX2 and AVX-512 alike), so its picks cannot differ by rounding. (An LLM stage's picks are compared exactly
too, though its scores come from the LLM, which rounds a padded row differently: no drawn example ties within
rounding on either instruction set; one that did would fail naming its record.)

Derandomised and time-bounded: every tiny model is built once per module, images are small, no shrinking phase (a
failure prints its falsifying example), no example database on disk.
"""

import functools
import math
import os
from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import make_image
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import vtoken
from vtoken.images import example_clip
from vtoken.methods.dycoke import frame_counts
from vtoken.zoo import TINY_MODELS, build_prompt

PADDING_SIDES = ("left", "right")
POSITIONS = ("original", "renumber")

# VTOKEN_FUZZ_SCALE=10 runs ten times as many examples (a deeper hunt than CI's)
SCALE = int(os.environ.get("VTOKEN_FUZZ_SCALE", "1"))
FUZZ = dict(
    derandomize=True,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)

# every built-in family; the facts below are docs/guide/methods.md's method x family tables and the tiny models' shapes
FAMILIES = sorted(TINY_MODELS)
VIDEO = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-onevision", "tiny-llava-next-video", "tiny-video-llava",
         "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-internvl",
         "tiny-perception-lm"}  # fmt: skip
QWEN3 = {"tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"}
OFFICIAL_LAYOUT = {"tiny-llava-next", "tiny-llava-next-video"}
OFFICIAL_LAYOUT_METHODS = {"fastervlm", "mmtok", "random", "pool", "hired", "mustdrop", "vispruner", "visionzip",
                           "cdpruner", "holov", "hiprune", "scope"}  # fmt: skip
# no [CLS] attention to score by
NO_CLS = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-onevision", "tiny-gemma3", "tiny-fastvlm"} | QWEN3
MROPE = {"tiny-qwen2-vl", "tiny-qwen2.5-vl"} | QWEN3  # (t, h, w) positions: an LLM stage keeps the original ones
SINGLE_CROP = {"tiny-llava", "tiny-video-llava", "tiny-fastvlm"}  # one crop per image
NEWLINES = {"tiny-llava-next", "tiny-llava-next-video", "tiny-onevision"}  # native image rows end with a newline
# docs/guide/methods.md's "n/a" cells (beyond NO_CLS for fastervlm/hired, layouts): method -> families refusing it
REFUSED = {
    "hired": NO_CLS | {"tiny-perception-lm"},  # PerceptionLM: the split needs the tile grid
    "fastervlm": NO_CLS,
    "fourier": {"tiny-llava-next"},  # anyres crops stitched and unpadded at full size
    "mustdrop": set(TINY_MODELS) - {"tiny-llava", "tiny-llava-next"},  # LLaVA-NeXT: official layout only
    "fastv": {"tiny-gemma3"},  # sliding-window/global layers not rebuilt after a drop
    "dart": {"tiny-gemma3"},
    "pyramiddrop": {"tiny-gemma3"},
    "sparsevlm": {"tiny-gemma3"} | MROPE,  # it renumbers positions (its merged tokens have none of their own)
    "visionzip": NO_CLS,
    "vispruner": NO_CLS,
    "vidcom2": set(TINY_MODELS) - VIDEO,  # videos only
    "dycoke": set(TINY_MODELS) - VIDEO,  # videos only
    # videos only, where the tower gives their signals: SigLIP's MAP head / ViT attention (OneVision, Qwen-VL)
    "fastvid": set(TINY_MODELS) - {"tiny-onevision", "tiny-qwen2-vl", "tiny-qwen2.5-vl"} - QWEN3,
    "holitom": set(TINY_MODELS) - {"tiny-onevision", "tiny-qwen2-vl", "tiny-qwen2.5-vl"} - QWEN3,
    # videos only, where a merge of the LLM-input tokens reaches the LLM as it is (no projector after selection)
    "prunevid": set(TINY_MODELS) - {"tiny-onevision", "tiny-qwen2-vl", "tiny-qwen2.5-vl"} - QWEN3,
    "holov": NO_CLS,  # score="cls"; score="received": every tower but FastVLM's (below)
    "hiprune": {"tiny-fastvlm"},  # score="received" (official); score="cls": NO_CLS (below)
    "scope": NO_CLS,  # saliency="cls" (official); saliency="received": every tower but FastVLM's (below)
}
NO_RECEIVED = {"tiny-fastvlm"}  # FastViTHD exposes no attention: no received_attention
# CDPruner's official relevance: a CLIP vision tower whose checkpoint has a text tower (a tiny CLIP is built to fit)
CLIP_FAMILIES = {"tiny-llava", "tiny-llava-next", "tiny-llava-next-video"}
IMAGE_ONLY = {"cdpruner", "holov", "hiprune", "scope"}
SENDS_CLS = {"tiny-llava", "tiny-llava-next", "tiny-llava-next-video", "tiny-video-llava"}  # VisionZip's [CLS]
HIRED_BANDS_ONLY = {"tiny-internvl"}  # the processor gives the tile count, not the grid: partition="tiles" refused
QUESTIONS = (
    "what is in the image?",
    "describe the image in detail.",
    "how many shapes are there? answer the question using a single word or phrase.",
    "is there a red circle at the top left?",
)
# every tiny model's LLM depth (a drop after the last layer saves nothing: drop points 0 .. depth - 2 fit) and its
# layers with attention rows to score by (Qwen3.5's hybrid LLM: linear-attention layers 0 and 2 have none)
LLM_LAYERS = {f: 4 if f in QWEN3 else 2 for f in TINY_MODELS}
LINEAR_ATTENTION = {"tiny-qwen3.5": {0, 2}, "tiny-qwen3.5-moe": {0, 2}}


def drop_points(family: str) -> list[int]:
    """LLM layers after which a prefill stage may drop."""
    if family in REFUSED["fastv"]:
        return []
    return [k for k in range(LLM_LAYERS[family] - 1) if k not in LINEAR_ATTENTION.get(family, set())]


@functools.cache
def tiny(family: str):
    """(model, processor), built once per module."""
    return TINY_MODELS[family]()


# --------------------------------------------------------------------------- strategies
fractions = st.floats(min_value=0.01, max_value=1.0)
budgets = st.one_of(fractions, st.integers(min_value=1, max_value=800), st.just(1.0))


ENCODER_METHODS = ("fastervlm", "random", "pool", "mmtok", "hired", "fourier", "mustdrop", "visionzip", "vispruner",
                   "divprune", "vidcom2", "dycoke", "fastvid", "holitom", "prunevid", "cdpruner", "holov", "hiprune",
                   "scope")  # fmt: skip
VIDEO_MERGERS = ("fastvid", "holitom", "prunevid")  # counts follow segments / windows
PREFILL_METHODS = ("fastv", "dart", "pyramiddrop", "sparsevlm")  # LLM stages that compose with encoder methods
METHODS = (*ENCODER_METHODS, *PREFILL_METHODS)


@functools.cache
def clip_for(family: str):
    """A tiny CLIP whose vision width fits `family`'s tower, with its tokenizer (built once)."""
    return vtoken.zoo.tiny_clip(*tiny(family))


@st.composite
def encoder_methods(draw, name: str, full: bool = False, family: str = "tiny-llava"):
    """Encoder-stage method `name` with drawn parameters (`full`: set to keep every token); CDPruner's CLIP
    relevance with a tiny CLIP fitting `family`'s tower where it has one."""
    budget = 1.0 if full else draw(budgets)
    if name == "cdpruner":
        if not full:  # k greedy steps (the PyTorch reference on CPU): small budgets keep it fast, and below the
            # tiny models' rank (64-wide tokens) its picks are clear of rounding, so batch and rows agree
            budget = draw(st.one_of(st.floats(0.01, 0.07), st.integers(1, 40)))
        relevance = draw(st.sampled_from(["clip", "llm"] if family in CLIP_FAMILIES else ["llm", "llm", "clip"]))
        clip = dict(zip(("clip", "clip_tokenizer"), clip_for(family), strict=True)) if family in CLIP_FAMILIES else {}
        theta = draw(st.one_of(st.none(), st.floats(0.05, 0.95)))
        question = draw(st.one_of(st.none(), st.sampled_from(QUESTIONS)))  # None: read from the prompt
        return vtoken.CDPruner(budget=budget, theta=theta, relevance=relevance, question=question, **clip)
    if name == "holov":  # the [CLS] score, or where there is none mostly the attention received
        score = draw(
            st.sampled_from(["received", "received", "cls"] if family in NO_CLS else ["cls", "cls", "received"])
        )
        chunks = draw(st.one_of(st.integers(1, 40), st.just("auto"), st.just(16)))
        return vtoken.HoloV(budget=budget, chunks=chunks, alpha=draw(st.floats(0, 1)), score=score)
    if name == "hiprune":  # split budgets share an image's over its crops (not a keep-all setting on anyres)
        score = draw(st.sampled_from(["received", "received", "cls"]))
        layers = st.sampled_from([None, None, 0, -1])  # None: the family's official block (or depth // 2 - 1)
        scope = "crop" if full else draw(st.sampled_from(["crop", "split"]))
        return vtoken.HiPrune(budget=budget, alpha=draw(st.floats(0, 1)), object_layer=draw(layers),
                              deep_layer=draw(layers), border=draw(st.sampled_from(["official", "grid"])),
                              score=score, scope=scope)  # fmt: skip
    if name == "scope":
        if not full:  # its greedy takes k steps (the PyTorch reference on CPU): small budgets keep the suite fast
            budget = draw(st.one_of(st.floats(0.01, 0.25), st.integers(1, 64)))
        saliency = draw(st.sampled_from(["received", "received", "cls"] if family in NO_CLS else ["cls", "received"]))
        return vtoken.SCOPE(budget=budget, alpha=draw(st.floats(0, 2)), saliency=saliency,
                            scope="crop" if full else draw(st.sampled_from(["crop", "split"])))  # fmt: skip
    if name in ("fastervlm", "random"):
        scope = draw(st.sampled_from(["crop", "image"]))
        seed = {"seed": draw(st.integers(0, 2**31))} if name == "random" else {}
        return vtoken.make_method(name, budget=budget, scope=scope, **seed)
    if name == "pool":
        return vtoken.Pool(budget=budget)
    if name == "mmtok":
        if not full:  # its greedy loop takes k steps: small budgets keep the suite fast
            budget = draw(st.one_of(st.floats(0.01, 0.25), st.integers(1, 64)))
        question = draw(st.one_of(st.none(), st.sampled_from(QUESTIONS)))  # None: read from the prompt
        return vtoken.MMTok(
            budget=budget, alpha=draw(st.floats(0, 2)), tau_vv=draw(st.floats(0.05, 1)), question=question
        )
    if name == "visionzip":
        if full or draw(st.booleans()):
            return vtoken.VisionZip(budget=budget)
        return vtoken.VisionZip(dominant=draw(st.integers(1, 120)), contextual=draw(st.integers(0, 40)))
    if name == "vispruner":
        return vtoken.VisPruner(budget=budget, important_ratio=draw(st.floats(0, 1)))
    if name in ("divprune", "vidcom2"):
        return vtoken.make_method(name, budget=budget)
    if name == "fastvid":  # d = 0 at budget 1: every token salient, nothing merged (the keep-all setting)
        if full:
            return vtoken.FastVID(budget=1.0, d=0.0)
        knobs = dict(c=draw(st.integers(1, 9)), tau=draw(st.floats(-1, 1)), d=draw(st.floats(0, 1)),
                     p=draw(st.integers(1, 5)), beta=draw(st.floats(0, 1)), seed=draw(st.integers(0, 99)))  # fmt: skip
        return vtoken.FastVID(budget=budget, **knobs)
    if name == "holitom":  # tau = 1 at budget 1: nothing static, every dynamic token kept (the keep-all setting)
        if full:
            return vtoken.HoliTom(budget=1.0, tau=1.0)
        knobs = dict(
            tau=draw(st.floats(-1, 1)),
            beta=draw(st.floats(0, 1)),
            k=draw(st.integers(1, 9)),
            d=draw(st.sampled_from([0.0, 0.0, draw(st.floats(0, 1))])),
            max_window=draw(st.integers(1, 6)),
        )
        return vtoken.HoliTom(budget=budget, **knobs)
    if name == "prunevid":  # tau = 1: nothing static; groups never clustered: every token kept (keep-all)
        if full:
            return vtoken.PruneVid(layer=None, tau=1.0, min_tokens=10**6)
        knobs = dict(tau=draw(st.floats(-1, 1)), segment_ratio=draw(st.floats(0.01, 1)),
                     cluster_ratio=draw(st.floats(0.01, 1)), k=draw(st.integers(1, 9)),
                     min_tokens=draw(st.integers(0, 20)), seed=draw(st.integers(0, 99)))  # fmt: skip
        # the cut inside the LLM after layer K, now and then: 0 fits a 2-layer LLM, 1 does not (refused)
        layer = draw(st.sampled_from([None, None, 0, 0, 1]))
        return vtoken.PruneVid(layer=layer, **knobs)
    if name == "hired":
        rate = 1.0 if full else draw(fractions)
        return vtoken.HiRED(rate=rate, alpha=draw(st.floats(0, 1)), partition=draw(st.sampled_from(["bands", "tiles"])))
    if name == "fourier":
        if full:
            return vtoken.FourierDCT(budget=1.0)
        knob = draw(st.sampled_from(["budget", "reserve", "ratio"]))
        value = {"budget": budget, "reserve": draw(st.integers(1, 30)), "ratio": draw(fractions)}[knob]
        return vtoken.FourierDCT(**{knob: value})
    if full:
        return vtoken.MustDrop(merge_threshold=1.01, layers=(0,), global_thr=0.0)
    return vtoken.MustDrop(
        merge_threshold=draw(st.floats(0.3, 1.01)),
        key_rate=draw(fractions),
        layers=(draw(st.sampled_from([0, 0, 0, 1])),),  # 1 is too deep for a 2-layer LLM: refused at patch
        global_thr=draw(st.floats(0, 0.05)),
        individual_thr=draw(st.floats(0, 0.05)),
    )


def scored_points(family: str) -> list[int]:
    """LLM layers whose attention rows a method may score with (PyramidDrop scores with the layer after its drop):
    softmax-attention layers after the first layer; on Qwen3.5, whose cache length is read from its first
    full-attention layer, only those after a drop that leaves that layer's cache whole."""
    linear = LINEAR_ATTENTION.get(family, set())
    first = min(set(range(LLM_LAYERS[family])) - linear)
    return [k for k in range(1, LLM_LAYERS[family]) if k not in linear and k - 1 >= first]


def prefill_fits(method, family: str) -> bool:
    """Whether prefill-stage `method` applies to `family` (its drop points and scoring layers exist there)."""
    if family in REFUSED[method.name]:
        return False
    drops = set(method.drop_layers(100))
    if method.name == "pyramiddrop":
        return {k + 1 for k in drops} <= set(scored_points(family))
    return drops <= set(drop_points(family))


@st.composite
def fastv(draw, family: str, full: bool = False):
    """FastV at a drop point of `family`'s LLM (thrice as likely) or any layer (too deep, linear attention: refused)."""
    fits = drop_points(family)
    layer = (fits or [0])[0] if full else draw(st.sampled_from(fits * 3 + list(range(LLM_LAYERS[family]))))
    positions = draw(st.sampled_from(["original", "renumber"]))
    return vtoken.FastV(layer=layer, keep=1.0 if full else draw(budgets), positions=positions)


@st.composite
def prefill_methods(draw, name: str, family: str, full: bool = False):
    """Prefill-stage method `name` with drawn parameters, at layers that fit `family` (thrice as likely) or any
    (refused); `full`: set to keep every token (SparseVLM has no such setting: it always drops one)."""
    if name == "fastv":
        return draw(fastv(family, full))
    depth = LLM_LAYERS[family]
    if name == "dart":  # reads the layer before `layer`
        fits = [k + 1 for k in drop_points(family)]
        layer = (fits or [1])[0] if full else draw(st.sampled_from(fits * 3 + list(range(1, depth + 1))))
        keep = 1.0 if full else draw(budgets)
        pivots = dict(image_pivots=draw(st.integers(1, 6)), text_pivots=draw(st.integers(0, 6)))
        return vtoken.DART(layer=layer, keep=keep, positions=draw(st.sampled_from(POSITIONS)), **pivots)
    if name == "pyramiddrop":
        fits = scored_points(family)
        if full:
            layers = tuple(fits[:1] or [1])
        else:
            pool = fits * 3 + list(range(1, depth + 1))
            layers = tuple(sorted(set(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2)))))
        ratios = sorted((1.0 if full else draw(st.floats(0.01, 1.0)) for _ in layers), reverse=True)
        return vtoken.PyramidDrop(layers=layers, ratios=tuple(ratios), positions=draw(st.sampled_from(POSITIONS)))
    fits = drop_points(family)
    pool = fits * 3 + list(range(depth))
    layers = tuple(sorted(set(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2)))))
    keep = tuple(draw(st.integers(1, 800)) for _ in layers)
    return vtoken.SparseVLM(keep=keep, layers=layers, seed=draw(st.integers(0, 2**31)))


@st.composite
def method_stacks(draw, name: str, family: str, full: bool = False):
    """A prefill method alone, or encoder method `name` alone or followed by a prefill method (stages compose)."""
    if name in PREFILL_METHODS:
        return [draw(prefill_methods(name, family, full))]
    if name == "dycoke":  # its decode stage reads layer - 1: one that fits (thrice as likely) or any (refused)
        fits = [k + 1 for k in drop_points(family)]
        layer = (fits or [1])[0] if full else draw(st.sampled_from(fits * 3 + list(range(1, LLM_LAYERS[family] + 1))))
        k, p = (0.0, 0.0) if full else (draw(st.floats(0, 1)), draw(st.floats(0, 1)))
        return [vtoken.DyCoke(k=k, layer=layer, p=p)]
    if name == "holitom" and not full and draw(st.booleans()):  # its own merge inside the LLM, at a layer that fits
        fits = [k + 1 for k in drop_points(family)]  # (thrice as likely) or any (refused)
        inner = draw(st.sampled_from(fits * 3 + list(range(1, LLM_LAYERS[family] + 1))))
        outer = draw(encoder_methods(name, family=family))
        return [replace(outer, inner_layer=inner, inner_ratio=draw(st.floats(0, 1)))]
    stack = [draw(encoder_methods(name, full, family))]
    if name not in ("mustdrop", "dycoke") and draw(st.booleans()):  # their own LLM stages
        after = draw(st.sampled_from(PREFILL_METHODS if not full else ("fastv", "dart", "pyramiddrop")))
        stack.append(draw(prefill_methods(after, family, full)))
    return stack


@st.composite
def rows(draw, family: str, modality: str, count: int):
    """`count` prompt rows: images of drawn sizes (1-2 per row) or a clip of 1-4 frames (as many in every row: the
    processors stack clips), and a question each. PerceptionLM's processor stacks only images with equal tile
    counts: there, every image of the batch has the same size."""
    out, frames = [], draw(st.integers(2 if family in QWEN3 else 1, 4))  # Qwen3's processor: 2 frames at least
    shared = (draw(st.integers(16, 480)), draw(st.integers(16, 480))) if family == "tiny-perception-lm" else None
    for _ in range(count):
        row = {"question": draw(st.sampled_from(QUESTIONS)), "images": [], "videos": []}
        if modality == "image":
            for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):
                width, height = shared or (draw(st.integers(16, 480)), draw(st.integers(16, 480)))
                row["images"].append(make_image(width, height, draw(st.integers(0, 99))))
        else:
            width, height = draw(st.integers(32, 160)), draw(st.integers(32, 160))
            row["videos"].append([f.resize((width, height)) for f in example_clip(frames, 96)])
        out.append(row)
    return out


def make_inputs(processor, batch: list[dict], side: str = "left"):
    prompts = [build_prompt(processor, r["question"], len(r["images"]), len(r["videos"])) for r in batch]
    images = [image for r in batch for image in r["images"]] or None
    if images and type(processor).__name__ == "Gemma3Processor":  # one list of images per prompt
        images = [r["images"] for r in batch]
    videos = [video for r in batch for video in r["videos"]] or None
    extra = {}
    if videos and getattr(getattr(processor, "video_processor", None), "do_sample_frames", False):
        extra["do_sample_frames"] = False  # Qwen3-VL / Qwen3.5: every frame, no fps metadata needed
    tokenizer = processor.tokenizer
    before, tokenizer.padding_side = tokenizer.padding_side, side
    try:
        return processor(text=prompts, images=images, videos=videos, padding=True, return_tensors="pt", **extra)
    finally:
        tokenizer.padding_side = before


# --------------------------------------------------------------------------- what the docs promise
def refused_at_patch(family: str, stack: list, layout: str) -> bool:
    """Where `patch` must refuse (the docs' "n/a" cells, layouts, drop points deeper than the LLM)."""
    for method in stack:
        name = method.name
        if name in ("fastervlm", "hired", "fourier", "visionzip", "vispruner", "vidcom2", *VIDEO_MERGERS) and (
            family in REFUSED[name]
        ):
            return True
        if name == "holov" and (family in REFUSED[name] if method.score == "cls" else family == "tiny-fastvlm"):
            return True
        if name == "cdpruner" and method.relevance == "clip" and family not in CLIP_FAMILIES:
            return True
        if name in ("hiprune", "scope"):
            cls = (method.score if name == "hiprune" else method.saliency) == "cls"
            # PerceptionLM serves [CLS] attention at its last block only, not HiPrune's two blocks
            cls_refused = NO_CLS | ({"tiny-perception-lm"} if name == "hiprune" else set())
            if family in (cls_refused if cls else NO_RECEIVED):
                return True
            if method.scope == "split" and family == "tiny-onevision":  # base view and grid selected apart
                return True
        if name == "hired" and method.partition == "tiles" and family in HIRED_BANDS_ONLY:
            return True
        if name == "mustdrop":
            if family not in ("tiny-llava", "tiny-llava-next") or (
                family == "tiny-llava-next" and layout != "official"
            ):
                return True
        if "encoder" in method.stages and layout == "official" and name not in OFFICIAL_LAYOUT_METHODS:
            return True
        if name in PREFILL_METHODS and not prefill_fits(method, family):
            return True
        if (
            name == "prunevid"
            and method.layer is not None
            and (method.layer not in drop_points(family) or len(stack) > 1)
        ):
            return True  # the cut inside the LLM after a layer it cannot follow, or beside another LLM stage
        if name == "holitom" and method.inner_layer is not None and method.inner_layer - 1 not in drop_points(family):
            return True  # the inner merge reads layer inner_layer - 1, a softmax-attention layer before the last
        if name == "dycoke" and (family in REFUSED[name] or method.layer - 1 not in drop_points(family)):
            return True  # its row comes from layer - 1, a softmax-attention layer before the last
        if "prefill" in method.stages and method.positions == "renumber" and family in MROPE:
            return True
    return False


def refused_at_call(family: str, stack: list, modality: str) -> bool:
    """Inputs a patched model refuses when the call starts: Fourier-VLM on anyres images of families whose videos
    it takes; VidCom2 on images."""
    if modality == "image" and stack[0].name in ("vidcom2", "dycoke", *VIDEO_MERGERS):
        return True
    if modality == "video" and stack[0].name in IMAGE_ONLY:
        return True
    return modality == "image" and family in ("tiny-onevision", "tiny-llava-next-video") and stack[0].name == "fourier"


def hooks(model) -> dict:
    """Every forward (pre-)hook on every module (transformers installs some of its own on the first call)."""
    return {
        name: (list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
        for name, m in model.named_modules()
    }


def snapshot(model) -> dict:
    return {"tensors": {k: v.clone() for k, v in model.state_dict().items()}, "hooks": hooks(model)}


def assert_restored(model, state: dict) -> None:
    """Nothing of vtoken left on the model: no handle, no generate wrapper, no added hook, the same tensors."""
    assert vtoken.handle_of(model) is None and "generate" not in model.__dict__
    assert hooks(model) == state["hooks"]
    current, tensors = model.state_dict(), state["tensors"]
    assert current.keys() == tensors.keys() and all(torch.equal(current[k], v) for k, v in tensors.items())


class Probe:
    """Forward pre-hooks on the LLM and its decoder layer `after` (the one after a drop): sequence lengths and the
    LLM's 2-D mask."""

    def __init__(self, model, after: int = 1):
        language_model = model.model.language_model
        self.seen = {}
        self.hooks = [
            language_model.register_forward_pre_hook(self._grab("llm"), with_kwargs=True),
            language_model.layers[after].register_forward_pre_hook(self._grab("after"), with_kwargs=True),
        ]

    def _grab(self, name):
        def hook(module, args, kwargs):
            hidden = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
            hidden = args[0] if hidden is None else hidden
            mask = kwargs.get("attention_mask")
            self.seen[name] = (hidden.shape[1], mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)

        return hook

    def remove(self):
        for hook in self.hooks:
            hook.remove()


# --------------------------------------------------------------------------- budget checks
def expected_fourier(method, grid: tuple[int, int]) -> int:
    """Tokens Fourier-VLM keeps of a crop grid, by its documented precedence: reserve, ratio, budget."""
    height, width = grid
    if method.reserve is not None:
        return min(method.reserve, height) * min(method.reserve, width)
    if method.ratio is not None:
        return max(int(height * method.ratio), 1) * max(int(width * method.ratio), 1)
    if isinstance(method.budget, int):
        side = max(1, math.isqrt(method.budget))
        return min(side, height) * min(side, width)
    per_axis = math.sqrt(method.budget)
    return max(int(height * per_axis + 0.5), 1) * max(int(width * per_axis + 0.5), 1)


def keep(budget, n: int) -> int:
    return vtoken.tokens_to_keep(budget, n) if n else 0


def check_encoder_records(family: str, method, records: list) -> None:
    stage = "encoder.merge" if method.name == "mustdrop" else "encoder"
    mine = [r for r in records if r.stage == stage]
    assert mine, f"no {stage} records"
    for r in records:
        if r.kept is not None and r.stage == "encoder":
            kept = r.kept.tolist()
            assert kept == sorted(set(kept)), r
            assert len(kept) == r.tokens_out or method.name == "visionzip", r  # VisionZip: the dominant patches
            assert all(0 <= k < r.grid[0] * r.grid[1] for k in kept), r
        assert 0 <= r.tokens_out <= r.tokens_in or r.stage == "decode.kv", r
    name = method.name
    if name in ("fastervlm", "random", "mmtok", "pool"):
        if method.scope == "crop":
            for r in mine:
                assert r.tokens_out == keep(method.budget, r.tokens_in), r
        else:  # one budget per image (OneVision: its base view and stitched grid are selected apart)
            groups = defaultdict(list)
            for r in mine:
                part = r.crop == 0 if family == "tiny-onevision" and r.modality == "image" else None
                groups[r.modality, r.image, part].append(r)
            for group in groups.values():
                total_in = sum(r.tokens_in for r in group)
                assert sum(r.tokens_out for r in group) == keep(method.budget, total_in), group
    elif name == "fourier":
        for r in mine:
            assert r.tokens_out == expected_fourier(method, r.grid), r
    elif name == "holov":  # one budget per image, over all its crops
        groups = defaultdict(list)
        for r in mine:
            groups[r.image].append(r)
        for group in groups.values():
            assert sum(r.tokens_out for r in group) == keep(method.budget, sum(r.tokens_in for r in group)), group
    elif name in ("hiprune", "scope"):  # per crop, or an image's budget shared equally by its crops
        groups = defaultdict(list)
        for r in mine:
            groups[r.modality, r.image].append(r)
        for group in groups.values():
            share = keep(method.budget, sum(r.tokens_in for r in group)) // len(group)
            for r in group:
                want = keep(method.budget, r.tokens_in) if method.scope == "crop" else min(share, r.tokens_in)
                assert r.tokens_out == want, (r, group)
    elif name in ("vispruner", "divprune", "cdpruner"):  # per crop; DivPrune: per image (video), its placed tokens
        for r in mine:
            assert r.tokens_out == keep(method.budget, r.tokens_in), r
    elif name == "visionzip":
        for r in mine:
            dominant, contextual = method.split(r.tokens_in)
            assert r.tokens_out == min(dominant + contextual, r.tokens_in), r
            if dominant + contextual < r.tokens_in:  # [CLS] among the D where the LLM can take it
                assert len(r.kept) == dominant - (family in SENDS_CLS), r
    elif name == "vidcom2":  # frame budgets follow the data: at least one token a frame, frames in order per video
        groups = defaultdict(list)
        for r in mine:
            assert r.modality == "video" and 1 <= r.tokens_out <= r.tokens_in, r
            groups[r.image].append(r.crop)
        assert all(crops == list(range(len(crops))) for crops in groups.values()), groups
    elif name in VIDEO_MERGERS:  # counts follow segments / windows: frames in order, at most their tokens
        groups = defaultdict(list)
        for r in mine:
            assert r.modality == "video" and 0 <= r.tokens_out <= r.tokens_in, r
            groups[r.image].append(r)
        for group in groups.values():
            assert [r.crop for r in group] == list(range(len(group))), group
            if name == "fastvid" and method.variant is None and family == "tiny-onevision":  # keep = int(T * r)
                per_frame = int(group[0].tokens_in * method.budget) if isinstance(method.budget, float) else \
                    min(method.budget, group[0].tokens_in)  # fmt: skip
                salient = per_frame - int(per_frame * method.d)
                assert all(r.tokens_out >= salient for r in group), group  # each frame keeps its salient tokens
    elif name == "dycoke":  # a frame's count follows from its place in the video (pairs, then every 4th)
        groups = defaultdict(list)
        for r in mine:
            assert r.modality == "video", r
            groups[r.image].append(r)
        for group in groups.values():
            assert [r.crop for r in group] == list(range(len(group))), group
            assert [r.tokens_out for r in group] == frame_counts(len(group), group[0].tokens_in, method.k), group
    elif name == "hired":
        groups = defaultdict(list)
        for r in mine:
            groups[r.modality, r.image].append(r)
        for group in groups.values():
            n = group[0].grid[0] * group[0].grid[1]
            if family in SINGLE_CROP or len(group) == 1 or group[0].modality == "video":
                for r in group:
                    assert r.tokens_out == min(r.tokens_in, int(n * method.rate)), r
            else:  # split by the base view's attention, remainders lost: at most the image's total
                assert sum(r.tokens_out for r in group) <= int(len(group) * n * method.rate), group
    elif name == "mustdrop":
        keys = [r for r in records if r.stage == "encoder.keyset"]
        assert len(keys) == len(mine)
        for merged, key in zip(mine, keys, strict=True):
            assert (merged.tokens_in - merged.tokens_out) % 8 == 0, merged  # each merged 3x3 window: 9 -> 1
            assert key.tokens_out == math.ceil(method.key_rate * merged.tokens_out), (merged, key)


def check_prefill_records(method, records: list, batch: int) -> None:
    layer = [r for r in records if r.stage.startswith("prefill.")]
    assert len(layer) == batch * len(method.drop_layers(100)), records
    assert [r.stage for r in layer] == [f"prefill.layer{k}" for k in method.drop_layers(100) for _ in range(batch)]
    received = {r.image: r.tokens_in for r in layer[:batch]}  # visual tokens each row brought into the LLM
    for r in layer:
        n, out = r.tokens_in, r.tokens_out
        if method.name == "fastv":
            assert out == keep(method.keep, n), r
        elif method.name == "dart":
            share = method.per_pivot(n) * (method.image_pivots + method.text_pivots)
            assert (
                out == n if method.keeps_all(n) else min(method.image_pivots, n) <= out <= method.image_pivots + share
            )
        elif method.name == "pyramiddrop":
            ratio = method.ratios[method.drop_layers(100).index(int(r.stage.removeprefix("prefill.layer")))]
            assert out == min(int(received[r.image] * ratio), n), r
        elif method.name == "sparsevlm":
            kept = min(method.counts[method.layers.index(int(r.stage.removeprefix("prefill.layer")))], n - 1)
            merged = (int((n - kept) * 0.3) + 1) // 10 + 1 if n else 0
            assert (out, r.extra["merged"]) == (max(kept, 0) + merged, merged), r
        elif method.name == "holitom":  # the inner merge keeps round(V (1 - r)), the rest merged into them
            assert out == round(n * (1 - method.inner_ratio)), r


# --------------------------------------------------------------------------- properties
def test_the_tables_describe_the_tiny_models():
    """The facts above about each tiny model's LLM are its own (a changed tiny model must update them)."""
    for family in FAMILIES:
        language_model = tiny(family)[0].model.language_model
        types = getattr(language_model.config, "layer_types", None) or []
        assert len(language_model.layers) == LLM_LAYERS[family], family
        linear = {i for i, kind in enumerate(types) if kind == "linear_attention"}
        assert linear == LINEAR_ATTENTION.get(family, set()), family


def _family_and_modality(data, name: str):
    """A family (those where method `name` applies drawn twice as often) and, for video families, a modality."""
    refused = REFUSED.get(name, set())
    family = data.draw(st.sampled_from(FAMILIES + [f for f in FAMILIES if f not in refused]), label="family")
    modality = data.draw(st.sampled_from(["image", "video"]), label="modality") if family in VIDEO else "image"
    return family, modality


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=24 * SCALE, **FUZZ)
@given(data=st.data())
def test_budgets_are_exact_errors_are_vtoken_errors_and_unpatch_restores(name, data):
    family, modality = _family_and_modality(data, name)
    model, processor = tiny(family)
    stack = data.draw(method_stacks(name, family), label="methods")
    layout = (
        data.draw(st.sampled_from(["native", "official"]), label="layout") if family in OFFICIAL_LAYOUT else "native"
    )
    inputs = make_inputs(processor, data.draw(rows(family, modality, 1), label="rows"))
    with torch.no_grad():
        reference = model(**inputs).logits
    state = snapshot(model)

    try:
        handle = vtoken.patch(model, stack, layout=layout)
    except Exception as err:
        assert isinstance(err, vtoken.VTokenError), repr(err)
        assert refused_at_patch(family, stack, layout), f"refused at patch: {err}"
        event("refused at patch")
        assert_restored(model, state)
        return
    assert not refused_at_patch(family, stack, layout), "patch should have refused"

    prefill = stack[-1] if "prefill" in stack[-1].stages else None
    drop = prefill.drop_layers(100)[0] if prefill is not None else 0
    probe = Probe(model, drop + 1)
    try:
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=2, do_sample=False)
            logits = model(**inputs).logits
    except Exception as err:
        assert isinstance(err, vtoken.VTokenError), repr(err)
        assert refused_at_call(family, stack, modality), f"refused at call: {err}"
        event("refused at call")
        return
    else:
        assert not refused_at_call(family, stack, modality), "the call should have been refused"
        records = list(handle.records)
    finally:
        probe.remove()
        vtoken.unpatch(model)

    length = inputs["input_ids"].shape[1]
    assert torch.equal(generated[:, :length], inputs["input_ids"]) and length < generated.shape[1] <= length + 2
    llm_length = probe.seen["llm"][0]
    encoder = stack[0] if "encoder" in stack[0].stages else None
    if encoder is not None:
        check_encoder_records(family, encoder, records)
        stage = "encoder.merge" if encoder.name == "mustdrop" else "encoder"
        counted_in = sum(r.tokens_in for r in records if r.stage == stage)
        counted_out = sum(r.tokens_out for r in records if r.stage == stage)
        ids = inputs["input_ids"]
        placeholders = sum(
            int((ids == getattr(model.config, a, -1)).sum()) for a in ("image_token_id", "video_token_id")
        )
        uncounted = llm_length - (length - placeholders + counted_out)  # newlines, pass-through [CLS] tokens
        if encoder.name == "visionzip" and family == "tiny-video-llava" and modality == "video":
            # a frame whose [CLS] VisionZip sends (counted) instead of the adapter (uncounted)
            counted_in += sum(1 for r in records if r.stage == "encoder" and len(r.kept) < r.tokens_out)
        if layout == "official":  # crops packed flat, nothing uncounted
            assert uncounted == 0, (length, placeholders, llm_length, counted_out)
        elif family in NEWLINES and modality == "image":  # newlines of rows left empty go too
            assert 0 <= uncounted <= placeholders - counted_in, (length, placeholders, llm_length, counted_out)
        else:  # the LLM input shrinks by exactly the dropped tokens
            assert length - llm_length == counted_in - counted_out, (length, llm_length, counted_in, counted_out)
    else:
        assert llm_length == length
    final = llm_length
    if prefill is not None:
        check_prefill_records(prefill, records, 1)
        dropped = sum(r.tokens_in - r.tokens_out for r in records if r.stage == f"prefill.layer{drop}")
        assert probe.seen["after"][0] == llm_length - dropped
        final -= sum(r.tokens_in - r.tokens_out for r in records if r.stage.startswith("prefill."))
    assert logits.shape[1] in (llm_length, final)

    assert_restored(model, state)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference)
    event(f"ran: {'+'.join(m.name for m in stack)}")


def applicable(family: str, modality: str, stack: list, fallback, layout: str = "native") -> list:
    """`stack` made to apply (refusals are the first property's business): LLM stages at the family's first drop
    point (original positions under M-RoPE), or left out where it has none; an encoder method that still cannot
    apply is replaced by `fallback`."""
    fits, scored = drop_points(family), scored_points(family)
    for i, method in enumerate(stack):
        positions = "original" if family in MROPE else getattr(method, "positions", None)
        if method.name == "fastv":
            stack[i] = replace(method, layer=fits[0], positions=positions) if fits else None
        if method.name == "dart":
            stack[i] = replace(method, layer=fits[0] + 1, positions=positions) if fits else None
        if method.name == "pyramiddrop":
            fitting = scored and family not in REFUSED["pyramiddrop"]
            stack[i] = (
                replace(method, layers=(scored[0],), ratios=method.ratios[:1], positions=positions) if fitting else None
            )
        if method.name == "sparsevlm":
            fitting = fits and family not in REFUSED["sparsevlm"]
            stack[i] = replace(method, layers=(fits[0],), keep=method.keep[:1]) if fitting else None
        if method.name == "mustdrop":
            stack[i] = replace(method, layers=(0,))
        if method.name == "dycoke" and fits:
            stack[i] = replace(method, layer=fits[0] + 1)
    stack = [m for m in stack if m is not None]
    if not stack or refused_at_patch(family, stack, layout) or refused_at_call(family, stack, modality):
        stack = [fallback] + [m for m in stack if m.name in PREFILL_METHODS]
    return stack


@pytest.mark.parametrize("name", [m for m in METHODS if m != "sparsevlm"])  # SparseVLM always drops one token
@settings(max_examples=12 * SCALE, **FUZZ)
@given(data=st.data())
def test_keeping_every_token_is_the_unpatched_model(name, data):
    family, modality = _family_and_modality(data, name)
    model, processor = tiny(family)
    stack = data.draw(method_stacks(name, family, full=True), label="methods")
    if stack[0].name == "hired" and family not in SINGLE_CROP and modality == "image":
        stack[0] = vtoken.Random(budget=1.0)  # HiRED re-splits an anyres image's budget even at rate 1
    if stack[0].name == "mustdrop" and family != "tiny-llava":
        stack[0] = vtoken.Pool(budget=1.0)  # on LLaVA-NeXT MustDrop needs the official (different) layout
    if stack[0].name == "vidcom2":
        stack[0] = vtoken.Random(
            budget=1.0
        )  # no keep-all setting: at R = 1 frames less unique than average lose tokens
    if stack[0].name == "fastvid" and family != "tiny-onevision":
        stack[0] = vtoken.Random(budget=1.0)  # the Qwen form keeps a segment's budget on sub-segment ends only
    stack = applicable(family, modality, stack, vtoken.Pool(budget=1.0))
    inputs = make_inputs(processor, data.draw(rows(family, modality, 1), label="rows"))
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtoken.patched(model, stack):
            logits = model(**inputs).logits
    assert logits.shape == reference.shape and (logits - reference).abs().max() <= 1e-5


FRAMEFUSION_REFUSED = {"tiny-qwen3.5": "linear attention", "tiny-qwen3.5-moe": "linear attention"}


@pytest.mark.parametrize("family", FAMILIES)
def test_framefusion_patches_video_families_and_refuses_the_rest_naming_why(family):
    """FrameFusion merges at call points inside the LLM's layers: image-only families are refused for taking videos
    only, hybrid LLMs (Qwen3.5) for linear attention; the model untouched. Elsewhere
    it patches (every layer but the last split), and unpatching leaves the model as it was."""
    model, _ = tiny(family)
    state = snapshot(model)
    refused = "video inputs only" if family not in VIDEO else FRAMEFUSION_REFUSED.get(family)
    if refused:
        with pytest.raises(vtoken.VTokenError, match=refused):
            vtoken.patch(model, vtoken.FrameFusion())
    else:
        vtoken.patch(model, vtoken.FrameFusion())
        vtoken.unpatch(model)
    assert_restored(model, state)
    assert not any("forward" in module.__dict__ for module in model.modules())


def _last_real_logits(logits: torch.Tensor, row: int, side: str, target: torch.Tensor) -> float:
    """max |logits - target| at the row's last real token: the last column when left-padded; a right-padded row's
    last real column is not known from outside, so the closest column counts."""
    if side == "left":
        return float((logits[row, -1] - target).abs().max())
    return float((logits[row] - target).abs().amax(-1).min())


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=9 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_padded_batch_equals_its_rows_one_by_one(name, data):
    family, modality = _family_and_modality(data, name)
    model, processor = tiny(family)
    stack = data.draw(method_stacks(name, family), label="methods")
    layout = (
        data.draw(st.sampled_from(["native", "official"]), label="layout") if family in OFFICIAL_LAYOUT else "native"
    )
    stack = applicable(family, modality, stack, vtoken.Random(budget=data.draw(budgets, label="budget")), layout)
    side = data.draw(st.sampled_from(PADDING_SIDES), label="padding side")
    batch = data.draw(rows(family, modality, data.draw(st.integers(2, 3), label="batch")), label="rows")
    items = [len(sample["images"]) + len(sample["videos"]) for sample in batch]
    with torch.no_grad(), vtoken.patched(model, stack, layout=layout) as handle:
        logits = model(**make_inputs(processor, batch, side)).logits
        records = list(handle.records)
        for row, sample in enumerate(batch):
            alone = model(**make_inputs(processor, [sample], side)).logits
            assert _last_real_logits(logits, row, side, alone[0, -1]) <= 1e-4, (row, side)
            first = sum(items[:row])
            mine = [
                _summary(r, first)
                for r in records
                if r.stage.startswith("encoder") and first <= r.image < first + items[row]
            ]
            mine += [_summary(r, row) for r in records if not r.stage.startswith("encoder") and r.image == row]
            assert mine == [_summary(r, 0) for r in handle.records], row


def _summary(record, offset: int) -> tuple:
    """What a record says about its crop, with `image` made relative to its row's first item."""
    kept = None if record.kept is None else record.kept.tolist()
    return record.stage, record.image - offset, record.crop, record.modality, record.tokens_in, record.tokens_out, kept
