"""What the adapter glue around an encoder-stage selection costs a GPU's host (`vtoken.launches`), counted on CPU.

For every encoder-stage method on LLaVA-1.5 (576 tokens) and LLaVA-NeXT (5 x 576), through `vtoken.patch`:
`model(**inputs)` is counted patched, the unpatched model's count is subtracted, and a second counter nested around
the method's own `select` takes out the selection (the methods' own launches are `test_kernels`'/the methods'
business). What remains is the adapter's: the prompt's shrinking, packing, records. It must force no host sync
beyond the reads its geometry needs (one read of LLaVA-NeXT's image sizes before the encoder, which the stock
forward reads more often; one of the native packing's newlines, whose count depends on which rows keep tokens),
and launch a small fixed number of kernels: the same at two budgets and for 3 or 5 crops.
"""

import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.launches import Launches, count_launches
from vtoken.registry import make_method, method_class
from vtoken.zoo import build_prompt, tiny_llava, tiny_llava_next, tiny_onevision

# methods whose encoder stage is not plain glue around `select`: MustDrop merges inside the vision tower and acts in
# the LLM (its own tests); video-only methods are counted on a video below
ENCODER = [n for n in vtoken.available_methods() if "encoder" in method_class(n).stages and n != "mustdrop"]
IMAGE = [n for n in ENCODER if "image" in method_class(n).modalities]
VIDEO = [n for n in ENCODER if "image" not in method_class(n).modalities]
BUDGETS = (0.25, 0.1)
KERNELS = 120  # "tens": LLaVA-1.5 needs ~20-40, LLaVA-NeXT ~75-101 (packing every crop of every image at once;
# HoloV's signals over them: every token projected, their packed order)


def _inputs(processor, size=None, video=False):
    if video:
        from vtoken.images import example_clip

        prompt = build_prompt(processor, "what happens?", num_images=0, num_videos=1)
        return processor(videos=[example_clip(4)], text=[prompt], return_tensors="pt")
    return processor(images=[make_image(*size)], text=[build_prompt(processor, "what is in the image?")],
                     return_tensors="pt")  # fmt: skip


def _params(name: str, budget: float) -> dict:
    if name == "dycoke":
        return {"p": budget, "layer": 1}  # a 2-layer LLM
    if name == "cdpruner":  # its CLIP relevance needs a CLIP checkpoint fitting the tower (test_cdpruner counts it)
        return {"budget": budget, "relevance": "llm"}
    if name == "prunevid":  # no budget; its encoder stage alone (its cut inside the LLM: test_video_llm_wiring)
        return {"layer": None, "cluster_ratio": budget}
    return {"budget": budget}


def adapter_counts(model, inputs, name, **params):
    """(net, glue): `net` = patched minus unpatched minus the method's `select`; `glue` = inside the adapter's
    `prepare` (the encoder, selection and prompt) minus `select` and the vision tower's own launches."""
    with torch.no_grad(), count_launches() as unpatched:
        model(**inputs)
    handle = vtoken.patch(model, name, **params)
    try:
        method = next(m for m in handle.methods if "encoder" in m.stages)
        adapter, selects, prepares = handle.adapter, [], []
        llm_stage = adapter.llm is not None
        select, prepare = method.select, adapter.calls.prepare

        def counted_select(tokens):
            with count_launches() as inner:
                out = select(tokens)
            selects.append(inner)
            return out

        def counted_prepare(kwargs):
            with count_launches() as inner:
                out = prepare(kwargs)
            prepares.append(inner)
            return out

        object.__setattr__(method, "select", counted_select)
        adapter.calls.prepare = counted_prepare
        with torch.no_grad(), count_launches() as patched:
            model(**inputs)
        assert handle.records, "records are built when read"
    finally:
        vtoken.unpatch(model)
    chosen = Launches(sum(s.kernels for s in selects), sum(s.syncs for s in selects))
    chosen.sync_sites = [site for s in selects for site in s.sync_sites]
    net = Launches(patched.kernels - unpatched.kernels - chosen.kernels, patched.syncs - unpatched.syncs - chosen.syncs)
    glue_sites = [site for p in prepares for site in p.sync_sites]
    for site in chosen.sync_sites:
        glue_sites.remove(site)
    glue = Launches(0, sum(p.syncs for p in prepares) - chosen.syncs)
    glue.sync_sites = glue_sites
    glue.llm_stage = llm_stage  # the method acts in the LLM too: the prompt's layout is read in `prepare`
    return net, glue


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


@pytest.fixture(scope="module")
def llava_next():
    return tiny_llava_next()


@pytest.mark.parametrize("name", IMAGE)
def test_llava_glue_forces_no_sync_and_a_fixed_few_kernels(llava, name):
    model, processor = llava
    inputs = _inputs(processor, (336, 336))
    counts = [adapter_counts(model, inputs, name, **_params(name, b)) for b in BUDGETS]
    reads = 1 if "question" in make_method(name).requires else 0  # MMTok decodes the question: one read
    for net, glue in counts:
        assert glue.syncs == reads, glue.sync_sites
        assert net.syncs == reads, (net, glue.sync_sites)
        assert 0 < net.kernels < KERNELS
    assert counts[0][0].kernels == counts[1][0].kernels, "the same launches at every budget"


def _next_reads(name: str, layout: str) -> int:
    """Reads LLaVA-NeXT's geometry needs: the image sizes (before the encoder, with the prompt's words for MMTok);
    the native packing's newlines, or the picks HiRED's official packing drops, after selecting."""
    after = layout == "native" or name in ("hired",) and layout == "official"
    return 1 + int(after and method_class(name).acts_on != "placed")


NEXT = [(n, "native") for n in IMAGE if "resized_grid" not in make_method(n).requires] + [
    (n, "official") for n in IMAGE if n in ("fastervlm", "mmtok", "random", "pool", "hired", "vispruner", "visionzip")
]


@pytest.mark.parametrize(("name", "layout"), NEXT)
def test_llava_next_glue_reads_only_its_geometry_and_launches_the_same_for_3_or_5_crops(llava_next, name, layout):
    model, processor = llava_next
    five, three = _inputs(processor, (600, 600)), _inputs(processor, (500, 300))
    assert five["pixel_values"].shape[1] == 5 and three["pixel_values"].shape[1] == 3
    counts = [adapter_counts(model, five, name, layout=layout, **_params(name, b)) for b in BUDGETS]
    counts.append(adapter_counts(model, three, name, layout=layout, **_params(name, BUDGETS[0])))
    reads = _next_reads(name, layout)
    for net, glue in counts:
        assert glue.syncs == reads, glue.sync_sites
        assert net.syncs <= 0, (net, glue.sync_sites)  # the stock forward reads the image sizes more often
        assert 0 < net.kernels < KERNELS
    assert len({net.kernels for net, _ in counts}) == 1, [net.kernels for net, _ in counts]


@pytest.mark.parametrize("name", VIDEO)
def test_video_methods_glue_forces_no_sync(name):
    model, processor = tiny_onevision()
    inputs = _inputs(processor, video=True)
    for budget in BUDGETS:
        _, glue = adapter_counts(model, inputs, name, **_params(name, budget))
        # a method acting in the LLM too (DyCoke's decoding steps) has the prompt's layout read once before the
        # encoder, the read its LLM stage made in the prefill before
        layout = ["read_layout"] if glue.llm_stage else []
        assert [site.split("(")[-1].rstrip(")") for site in glue.sync_sites] == layout, glue.sync_sites


def test_a_batch_reads_its_rows_once(llava):
    """Several rows: which row holds which image is written only in input_ids: read once, before the encoder."""
    model, processor = llava
    prompts = [build_prompt(processor, q) for q in ("what is in the image?", "describe it.")]
    inputs = processor(images=[make_image(336, 336), make_image(300, 400, seed=1)], text=prompts,
                       return_tensors="pt", padding=True)  # fmt: skip
    net, glue = adapter_counts(model, inputs, "fastervlm", budget=0.25)
    assert glue.syncs == 1 and "read_layout" in glue.sync_sites[0], glue.sync_sites


@pytest.mark.parametrize("name", [n for n in IMAGE if "question" in make_method(n).requires])
def test_the_question_reaches_the_device_without_a_sync(llava, name):
    """A method reading the prompt's question (MMTok, CDPruner's relevance) gets its words embedded on the model's
    device from host token ids without a sync: no tensor made by the tokenizer (a table of host data), one
    non-blocking copy from pinned memory on a GPU (`on_device`)."""
    model, _ = llava
    with vtoken.patched(model, make_method(name, **_params(name, 0.25))) as handle, torch.no_grad():
        with count_launches() as counted:
            embedded = handle.adapter.embed_text("what is in the image?")
    assert counted.syncs == 0, counted.sync_sites
    assert embedded.dim() == 2 and embedded.shape[0] > 0
