"""What a patched forward adds on a GPU's host, counted on CPU (vtoken.launches): every encoder-stage method through
`vtoken.patch` on LLaVA-1.5 (576 tokens) and LLaVA-NeXT (a base view and four sub-images), VidCom2 on a
LLaVA-NeXT-Video clip. The patched forward's kernels and syncs minus the unpatched model's are split into the
selection's share (a second counter around the method's `select`) and the adapter's (the rest: encoding
bookkeeping, prompt packing, records, the question's tokenisation). The selection forces no host sync beyond its
definition and launches the same short burst at two budgets; the adapter's share reads nothing back (beyond a
question's host-side tokenisation) and stays within tens of kernels."""

import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.launches import count_launches
from vtoken.zoo import TINY_MODELS, build_prompt

BUDGETS = (0.25, 0.1)
KERNELS = 100
ADAPTER_KERNELS = 120  # LLaVA-NeXT's packing of five crops, HoloV's signals over them
QUESTION_READS = 3  # the tokenizer's host tensors of the question (ids, mask) and its length
# reads a method's definition makes: HiRED's crop budgets follow the early attention (anyres images), MMTok's
# valid tokens on LLaVA-1.5 are read from the pixels (the pad-to-square border), VidCom2's frame budgets, and how
# many of HoloV's image-wide top-k fall in each LLaVA-NeXT crop
READS = {("hired", "tiny-llava-next"): 1, ("mmtok", "tiny-llava"): 1, ("vidcom2", "tiny-llava-next-video"): 1,
         ("holov", "tiny-llava-next"): 1}  # fmt: skip
IMAGE_METHODS = ["random", "pool", "fastervlm", "hired", "fourier", "visionzip", "vispruner", "divprune", "mmtok",
                 "cdpruner", "holov", "hiprune", "scope"]  # fmt: skip
PARAMS = {"cdpruner": {"relevance": "llm"}}  # CLIP relevance needs a CLIP checkpoint: test_cdpruner counts it
CASES = [
    (name, family)
    for family in ("tiny-llava", "tiny-llava-next")
    for name in IMAGE_METHODS
    if (name, family) != ("fourier", "tiny-llava-next")
]  # fmt: skip  (refused: unpadded crops)
CASES.append(("vidcom2", "tiny-llava-next-video"))


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, family):
    if family not in models:
        models[family] = TINY_MODELS[family]()
    return models[family]


def _inputs(processor, family):
    if family == "tiny-llava-next-video":
        from vtoken.images import example_clip

        prompt = build_prompt(processor, "what happens?", num_images=0, num_videos=1)
        return processor(videos=[example_clip(4)], text=[prompt], return_tensors="pt")
    prompt = build_prompt(processor, "what is in the image? answer with one word.")
    return processor(images=[make_image(600, 400)], text=[prompt], return_tensors="pt")


class _Counted:
    """Wraps a method's `select`: the selection's launches, less those of the adapter's question embedding."""

    def __init__(self, method) -> None:
        self.method, self.select, self.runs = method, method.select, []

    def __call__(self, tokens):
        embeds = []
        if tokens.question is not None:
            embed = tokens.question.embed

            def counted_embed(text):
                with count_launches() as launches:
                    out = embed(text)
                embeds.append(launches)
                return out

            tokens.question.embed = counted_embed
        with count_launches() as launches:
            out = self.select(tokens)
        launches.kernels -= sum(e.kernels for e in embeds)
        launches.syncs -= sum(e.syncs for e in embeds)
        self.runs.append(launches)
        return out


def _measure(model, inputs, name, budget):
    """(selection kernels, selection syncs, adapter kernels, adapter syncs, selection description)."""
    with torch.no_grad():
        model(**inputs)
        with count_launches(sites=False) as plain:
            model(**inputs)
        method = vtoken.make_method(name, budget=budget, **PARAMS.get(name, {}))
        counted = _Counted(method)
        method.select = counted
        with vtoken.patched(model, method):
            model(**inputs)  # warm: per-shape caches
            counted.runs.clear()
            with count_launches() as patched:
                model(**inputs)
    kernels = sum(r.kernels for r in counted.runs)
    syncs = sum(r.syncs for r in counted.runs)
    added_kernels, added_syncs = patched.kernels - plain.kernels, patched.syncs - plain.syncs
    described = "; ".join(r.describe() for r in counted.runs)
    return kernels, syncs, added_kernels - kernels, added_syncs - syncs, described, patched.describe()


@pytest.mark.parametrize("name, family", CASES)
def test_patched_selection_adds_a_fixed_burst_and_no_sync(models, name, family):
    model, processor = _model(models, family)
    inputs = _inputs(processor, family)
    runs = [_measure(model, inputs, name, budget) for budget in BUDGETS]
    for kernels, syncs, adapter_kernels, adapter_syncs, selection, whole in runs:
        message = (f"{name} on {family}: selection {kernels} kernels, {syncs} syncs ({selection}); adapter "
                   f"{adapter_kernels} kernels, {adapter_syncs} syncs (whole patched forward: {whole})")  # fmt: skip
        assert syncs == READS.get((name, family), 0), message
        assert kernels <= KERNELS, message
        # the adapter around it: no read of the device (the prompt's layout is read once by the unpatched model
        # too); a method that reads the question tokenises it on the host (host tensors, counted conservatively)
        question = "question" in vtoken.make_method(name, **PARAMS.get(name, {})).requires
        assert adapter_syncs <= (QUESTION_READS if question else 0), message
        assert adapter_kernels <= ADAPTER_KERNELS, message
    assert runs[0][0] == runs[1][0], [r[:4] for r in runs]
