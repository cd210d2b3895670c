"""The LLM stages at GPU speed, counted on the CPU (`vtoken.launches`): every LLM-stage method patched on a LLaVA-1.5
with 576 visual tokens launches a short fixed burst per drop, the same at 16 and 32 LLM layers, forces no host
sync beyond its documented allowance, and its decoding steps add a few kernels and no sync. On CUDA the same drops
run under `no_host_syncs()` (sync debug mode "error")."""

import contextlib

import pytest
import torch
from conftest import video_inputs

import vtoken
from vtoken.adapters import hf
from vtoken.adapters.llm import prefill
from vtoken.launches import count_launches, no_host_syncs
from vtoken.zoo import build_prompt, tiny_llava

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# method, its drop layers on both depths, the most kernels one drop may launch, the syncs one drop may force
# (DART: its pivots' visiting order; MustDrop: its threshold counts), and the most kernels a decoding step adds
# (after the first step of a cache: what does not change between steps is kept on the cache's views)
STEP_KERNELS = 8
# (today: FastV 25, DART 65, PyramidDrop 33 / 32, SparseVLM 74 / 80, MustDrop 42 / 34: the attention read is one op
# with the rotary inside, a view is rebuilt in ~10 kernels, text rows move with the view)
METHODS = {
    "fastv": (lambda: vtoken.FastV(layer=2, keep=0.25), 28, 0, STEP_KERNELS),
    "dart": (lambda: vtoken.DART(layer=2, keep=0.222), 68, 1, STEP_KERNELS),
    "pyramiddrop": (lambda: vtoken.PyramidDrop(layers=(4, 8, 12)), 36, 0, STEP_KERNELS),
    "sparsevlm": (lambda: vtoken.SparseVLM(budget=192, layers=(1, 3, 7)), 84, 0, STEP_KERNELS),
    "mustdrop": (lambda: vtoken.MustDrop(global_thr=0.011, individual_thr=0.01), 45, 1, STEP_KERNELS),
}
# issue 40: at batch 1 a 7B LLaVA is host-bound on a GPU (each kernel ~11-17 us), so what a patched prefill adds
# over the unpatched one (its drops, its start, MustDrop's KV cut) is bounded: 40 kernels per drop and 40 more.
# Methods over it, with what they add today (strict: getting under the bound turns the test red, to drop the
# entry): SparseVLM's recycling (DPC-kNN clustering of the dropped tokens, ~35 kernels per drop, the merged tokens'
# placement in the view) is not one op yet, and its raters are chosen from the input embeddings (~30) per prefill.
PER_DROP, PER_PREFILL = 40, 40
OVER_THE_BOUND = {"sparsevlm": 281}
# the prompt's layout: the call path knows it before the prefill (read with the rest of what a call reads before its
# encoder, followed through the shrink on the host), so a prefill reads nothing
PREFILL_READS = 0
CALL_READS = 1  # that read, for a one-row call of a fixed-size family (which reads nothing else before its encoder)


@pytest.fixture(scope="module", params=[16, 32], ids=lambda n: f"{n}-layers")
def llava(request):
    model, processor = tiny_llava(text_layers=request.param)
    model.to(DEVICE)
    from PIL import Image
    from skimage import data

    prompt = build_prompt(processor, "what is in the image? answer with one word.")
    inputs = processor(images=[Image.fromarray(data.astronaut())], text=[prompt], return_tensors="pt").to(DEVICE)
    return model, inputs


@contextlib.contextmanager
def counted_drops(monkeypatch, check=None):
    """Count every drop's launches (`PrefillRun.drop` wrapped); `check`: a context around each drop
    (no_host_syncs)."""
    seen = []
    drop = prefill.PrefillRun.drop

    def counting(run, layer, hidden):
        with count_launches() as counted, check() if check else contextlib.nullcontext():
            out = drop(run, layer, hidden)
        seen.append(counted)
        return out

    monkeypatch.setattr(prefill.PrefillRun, "drop", counting)
    yield seen


@contextlib.contextmanager
def llm_segment(model):
    """Count what the language model's forward launches (its own layers and every LLM-stage hook inside it)."""
    lm = model.model.language_model
    found = []

    def start(module, args, kwargs):
        found.append(count_launches(sites=True))
        found[-1].counted = found[-1].__enter__()

    def stop(module, args, output):
        found[-1].__exit__(None, None, None)

    hooks = [lm.register_forward_pre_hook(start, with_kwargs=True, prepend=True), lm.register_forward_hook(stop)]
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()


def prefill_and_step(model, inputs, first=False):
    """(the LLM's prefill launches, a decoding step's launches: the second, or the `first`) of a forward with a
    cache and two more tokens."""
    with torch.no_grad(), llm_segment(model) as found:
        out = model(**inputs, use_cache=True)
        cache = hf.cache_out(out)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], 1)
        out = model(input_ids=token, attention_mask=mask, **hf.cache_kwargs(cache), use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        model(input_ids=token, attention_mask=mask, **hf.cache_kwargs(cache), use_cache=True)
    return found[0].counted, found[1 if first else 2].counted


@pytest.mark.parametrize("name", list(METHODS))
def test_each_drop_is_a_short_fixed_burst(llava, name, monkeypatch):
    """Per drop: at most the method's bound of kernels (tens), its allowance of syncs; per prefill, the layout
    read on top; a decoding step adds a few kernels and no sync. The drops are the same at 16 and 32 layers."""
    model, inputs = llava
    make, most, syncs, step_kernels = METHODS[name]
    with torch.no_grad():
        model(**inputs)  # warm: transformers' own first-call work
    base_prefill, base_step = prefill_and_step(model, inputs)
    with vtoken.patched(model, make()), counted_drops(monkeypatch) as drops:
        model(**inputs)
        drops.clear()
        patched_prefill, patched_step = prefill_and_step(model, inputs)
    method = make()
    layers = model.config.text_config.num_hidden_layers
    assert len(drops) == len(method.drop_layers(layers))
    for counted in drops:
        assert counted.kernels <= most, counted.describe()
        assert counted.syncs <= syncs, counted.describe()
    added = patched_prefill.syncs - base_prefill.syncs
    assert added <= PREFILL_READS + syncs * len(drops), patched_prefill.describe()
    assert patched_step.syncs <= base_step.syncs, patched_step.describe()
    assert patched_step.kernels - base_step.kernels <= step_kernels, patched_step.describe()
    BURSTS.setdefault(name, {})[layers] = [c.kernels for c in drops]
    if len(BURSTS[name]) == 2:  # both depths seen: the bursts do not grow with the LLM
        assert BURSTS[name][16] == BURSTS[name][32]


BURSTS: dict = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                strict=True, reason=f"adds {OVER_THE_BOUND[name]} kernels per prefill (issue 40: not yet)"
            ),
        )
        if name in OVER_THE_BOUND
        else name
        for name in METHODS
    ],
)
def test_a_prefill_adds_at_most_40_kernels_per_drop_and_40_more(llava, name, monkeypatch):
    """Issue 40's bound: the kernels a patched prefill launches over the unpatched prefill (the drops, the run's
    start, the output-aware KV cut) are at most 40 per drop plus 40."""
    model, inputs = llava
    make = METHODS[name][0]
    with torch.no_grad():
        model(**inputs)  # warm: transformers' own first-call work
    base = prefill_and_step(model, inputs)[0]
    with vtoken.patched(model, make()), counted_drops(monkeypatch) as drops:
        model(**inputs)
        drops.clear()
        patched = prefill_and_step(model, inputs)[0]
    added = patched.kernels - base.kernels
    assert added <= PER_DROP * len(drops) + PER_PREFILL, f"{added} kernels added by {len(drops)} drops"


def test_dycoke_decoding_step_reads_the_row_once(monkeypatch):
    """DyCoke's decoding steps: the row at layer L - 1 is one fused op; its one host read per step is whether a row
    re-selects (it sizes the gathered cache), and a re-selecting step gathers the kept entries of layers >= L."""
    from vtoken.zoo import TINY_MODELS

    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = video_inputs(processor, 6)
    with torch.no_grad():
        model(**inputs)
    base = prefill_and_step(model, inputs, first=True)[1]
    with vtoken.patched(model, vtoken.DyCoke(k=0.0, layer=1, p=0.5)):
        step = prefill_and_step(model, inputs, first=True)[1]  # a first step always selects
    assert step.ops["vtoken::visual_attention"] == 1, step.describe()
    assert step.syncs - base.syncs <= 1, step.describe()
    layers = model.config.text_config.num_hidden_layers
    assert step.ops["gather"] >= 2 * (layers - 1), step.describe()  # keys and values of every layer >= L


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (sync debug mode)")
@pytest.mark.parametrize("name", ["fastv", "pyramiddrop", "sparsevlm"])
def test_no_sync_inside_a_drop_on_cuda(llava, name, monkeypatch):
    """Under `torch.cuda.set_sync_debug_mode("error")` every drop of the sync-free methods runs."""
    model, inputs = llava
    make = METHODS[name][0]
    with vtoken.patched(model, make()), counted_drops(monkeypatch, no_host_syncs) as drops, torch.no_grad():
        model(**inputs)
    assert drops


def test_mustdrop_whole_forward_reads_only_what_its_thresholds_decide(llava):
    """MustDrop's whole forward (its merge in the vision tower, its drops in the LLM) reads back what its thresholds
    decide (the merge's plan and its kept count, one count per drop) and the prompt's layout, nothing more: the
    records of every stage are built when read, after the forward."""
    model, inputs = llava
    make = METHODS["mustdrop"][0]
    with torch.no_grad():
        model(**inputs)
        with count_launches() as plain:
            model(**inputs)
        with vtoken.patched(model, make()) as handle:
            model(**inputs)
            with count_launches() as patched:
                model(**inputs)
            assert [r.stage for r in handle.records][:2] == ["encoder.merge", "encoder.keyset"]
    drops = len(make().drop_layers(model.config.text_config.num_hidden_layers))
    assert patched.syncs - plain.syncs <= CALL_READS + 2 + drops, patched.describe()


def _layout_checked(monkeypatch):
    """Wrap `PrefillRun.start`: every prefill's layout from the call path (host counts) is compared with the one read
    back from the device (what the prefill read before); returns the list of (host, read) pairs seen."""
    from vtoken.adapters.llm.views import Layout

    seen = []
    start = prefill.PrefillRun.start.__func__

    def checked(cls, stages, embeds, kwargs, visual, cache):
        mask = kwargs.get("attention_mask")
        batch, length = visual.shape
        mask = torch.ones(batch, length, dtype=torch.long) if mask is None else mask.long()
        seen.append((stages.adapter.layout_for((batch, length)), Layout.read(mask, visual.to(mask.device))))
        return start(cls, stages, embeds, kwargs, visual, cache)

    monkeypatch.setattr(prefill.PrefillRun, "start", classmethod(checked))
    return seen


@pytest.mark.parametrize(
    "family, methods, side, beams",
    [
        ("tiny-llava", lambda: vtoken.FastV(layer=0, keep=0.25), "left", 1),
        ("tiny-llava", lambda: [vtoken.HiRED(budget=0.3), vtoken.FastV(layer=0, keep=0.25)], "right", 1),
        ("tiny-llava", lambda: [vtoken.VisionZip(budget=0.2), vtoken.SparseVLM(keep=(40,), layers=(0,))], "left", 2),
        ("tiny-llava-next", lambda: [vtoken.HiRED(budget=0.3), vtoken.PyramidDrop((1,), (0.5,))], "left", 1),
        ("tiny-llava-next", lambda: [vtoken.HiRED(budget=0.3), vtoken.PyramidDrop((1,), (0.5,))], "right", 2),
    ],
)
def test_prefill_layout_is_the_call_paths(family, methods, side, beams, monkeypatch, photos):
    """The prefill's layout (real, visual and text tokens per row, padding side, runs) comes from the call path's host
    counts, followed through the shrink (rows losing different numbers of tokens, re-padded), repeated for beams:
    the same as reading the LLM's input back, which the prefill no longer does."""
    from vtoken.zoo import TINY_MODELS

    model, processor = TINY_MODELS[family]()
    processor.tokenizer.padding_side = side
    images = [photos["chelsea"], photos["rocket"]]
    prompts = [build_prompt(processor, q) for q in ["what is it?", "what is in the image? answer in one word."]]
    inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    seen = _layout_checked(monkeypatch)
    with vtoken.patched(model, methods()), torch.no_grad():
        model(**inputs)
        model.generate(**inputs, max_new_tokens=2, do_sample=False, num_beams=beams, num_return_sequences=beams)
    assert len(seen) == 2
    for host, read in seen:
        assert host is not None
        assert host == read


@pytest.mark.parametrize(
    "methods",
    [
        lambda: vtoken.FastV(layer=0, keep=0.25),
        lambda: [vtoken.VisionZip(budget=0.2), vtoken.FastV(layer=0, keep=0.25)],
    ],
)
def test_generate_without_a_mask_reads_the_mask_it_infers(methods, monkeypatch, photos):
    """A padded batch given to generate without its attention mask: generate infers one from the pad tokens, which
    the call path never saw; the prefill then reads the layout of what the LLM gets (and agrees with it)."""
    from vtoken.zoo import TINY_MODELS

    model, processor = TINY_MODELS["tiny-llava"]()
    processor.tokenizer.padding_side = "left"
    prompts = [build_prompt(processor, q) for q in ["what is it?", "what is in the image? answer in one word."]]
    inputs = processor(images=[photos["chelsea"], photos["rocket"]], text=prompts, return_tensors="pt", padding=True)
    inputs.pop("attention_mask")
    seen = _layout_checked(monkeypatch)
    with vtoken.patched(model, methods()), torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    assert [host for host, _ in seen] == [None]


def test_an_llm_stage_adds_no_read_to_a_batch_an_encoder_stage_reads(photos):
    """A padded batch under an encoder-stage method is read once before the encoder (which row holds which image);
    the LLM stage's layout rides on that read: the whole forward syncs as often with FastV as without."""
    from vtoken.zoo import TINY_MODELS

    model, processor = TINY_MODELS["tiny-llava"]()
    processor.tokenizer.padding_side = "left"
    prompts = [build_prompt(processor, q) for q in ["what is it?", "what is in the image? answer in one word."]]
    inputs = processor(images=[photos["chelsea"], photos["rocket"]], text=prompts, return_tensors="pt", padding=True)

    def syncs(methods) -> int:
        with vtoken.patched(model, methods), torch.no_grad():
            model(**inputs)
            with count_launches() as counted:
                model(**inputs)
        return counted.syncs

    alone = syncs(vtoken.VisionZip(budget=0.3))
    assert syncs([vtoken.VisionZip(budget=0.3), vtoken.FastV(layer=0, keep=0.25)]) == alone


@pytest.mark.parametrize("name", list(METHODS))
def test_a_padded_batchs_decoding_step_adds_a_few_kernels(llava, name, photos):
    """In a left-padded batch every view that needs a mask gets one in a decoding step: after the first step of a
    cache, its mask over the view's prompt slots is held and the LLM's own new columns follow (one concatenation),
    the renumbered positions' rotary rows are gathered from the LLM's own table (a subtraction, two gathers): at
    most `STEP_KERNELS` more than the unpatched step, and no sync."""
    model, _ = llava
    processor = tiny_llava(text_layers=2)[1]
    processor.tokenizer.padding_side = "left"
    prompts = [build_prompt(processor, q) for q in ["what is it?", "what is in the image? answer in one word."]]
    inputs = processor(images=[photos["chelsea"], photos["rocket"]], text=prompts, return_tensors="pt", padding=True)
    inputs = inputs.to(DEVICE)
    with torch.no_grad():
        model(**inputs)
    base = prefill_and_step(model, inputs)[1]
    with vtoken.patched(model, METHODS[name][0]()):
        step = prefill_and_step(model, inputs)[1]
    assert step.syncs <= base.syncs, step.describe()
    assert step.kernels - base.kernels <= STEP_KERNELS, step.describe()
