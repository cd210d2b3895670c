"""Every registered method through `vtoken.patch` and `generate`, its host syncs allowed by name and count.

One table (`READS`) says, per method on the tiny family it is tried on, every read of the device a patched
`generate` adds to the unpatched one: the method's own documented reads (HiRED's crop budgets, VidCom2's frame
budgets, FastVID's and HoliTom's merge counts, DART's and MustDrop's kept counts) and the adapter's (the prompt's
layout, LLaVA-NeXT's packing, the LLM stages' layout read, DyCoke's decoding steps), each by "file (function)".

- On CUDA (skipped elsewhere): the patched `generate` runs under sync debug mode "warn" with every real sync's site
  listed (`vtoken.launches.cuda_sync_sites`, where "error" would stop at the first documented one): a sync in
  vtoken's code must be allowed there by name, at most as often; the model's own syncs no more than unpatched; and
  after one warm-up call nothing is compiled, autotuned or captured any more.
- On CPU: the same `generate` under the launch counter, whose vtoken sites must equal the table exactly, so the
  table cannot go stale where no GPU is lent.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import torch
from conftest import make_image, video_inputs

import vtoken
from vtoken.applicability import fitting_params
from vtoken.launches import count_events, count_launches, cuda_sync_sites
from vtoken.zoo import TINY_MODELS, build_prompt

VIDEO = ("dycoke", "fastvid", "framefusion", "holitom", "prunevid", "vidcom2")
IMAGE_LLM = ("dart", "fastv", "fourier", "mustdrop", "pixelprune", "pyramiddrop", "sparse_prefill", "sparsevlm", "tome")
PARAMS = {"cdpruner": dict(relevance="llm"), "sparse_prefill": dict(block_size=16, min_length=16)}
# on CUDA sparse prefill runs vtoken's kernel (auto would time FlexAttention too, compiling it for every shape)
CUDA_PARAMS = {"sparse_prefill": dict(backend="triton")}
GENERATE = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)

# the adapter's reads around an encoder selection on LLaVA-NeXT: the prompt's layout (which row holds which image)
# and, for a native packing of crops, the newlines after the kept rows
NEXT = {"prompt.py (read_layout)": 1, "anyres.py (pack)": 1}
# an LLM stage's prompt layout, read by the call path before anything runs (none in the prefill); a call that reads
# before its encoder anyway (an encoder-stage method's `read_layout`) reads it there
LAYOUT = {"calls.py (note_layout)": 1}
ENCODER_LAYOUT = {"prompt.py (read_layout)": 1}
READS: dict[str, dict[str, int]] = {
    "cdpruner": NEXT,
    "dart": {**LAYOUT, "dart.py (keep_mask)": 1},  # its pivots' visiting order
    "divprune": {"prompt.py (read_layout)": 1},
    "dycoke": {**ENCODER_LAYOUT, "selection.py (select)": 2},  # each decoding step's re-selection (2 steps)
    "fastervlm": NEXT,
    "fastv": LAYOUT,
    "fastvid": {"fastvid.py (video_selection)": 1},  # the merged counts of every frame
    "fourier": {},
    # where the frames sit comes with the layout's read (its slot table built on the host, copied once); how many
    # tokens a merge call flags (data: the similarities decide it) is read at each merge call (2 on the tiny LLM)
    "framefusion": {**LAYOUT, "framefusion.py (step)": 2},
    "hiprune": NEXT,
    "pixelprune": {"pixelprune.py (select_input)": 1},  # the kept units' count, read before the tower runs
    "scope": NEXT,
    "tome": {},
    "hired": {**NEXT, "hired.py (select)": 1},  # the crops' budgets follow the early attention
    "holitom": {"fastvid.py (video_selection)": 1},
    "holov": {**NEXT, "holov.py (select)": 1},  # how many of the image-wide top-k fall in each crop
    "mmtok": NEXT,
    "mustdrop": {**ENCODER_LAYOUT, "mustdrop.py (plan_merge)": 1, "mustdrop.py (select)": 1, "prefill.py (drop)": 1},
    "pool": NEXT,
    "prunevid": {**ENCODER_LAYOUT, "fastvid.py (video_selection)": 1},  # its merged counts and groups, one read
    "pyramiddrop": LAYOUT,
    "random": NEXT,
    "sparse_prefill": {},
    "sparsevlm": LAYOUT,
    "vidcom2": {"vidcom2.py (select)": 1},  # the frames' budgets follow the data
    "visionzip": NEXT,
    "vispruner": NEXT,
}
# the question's token ids reach the device without a sync (host ints, one pinned non-blocking copy): nothing to
# allow for a method reading the prompt's question, on the CPU counter or a GPU
QUESTION_CPU: dict[str, int] = {}
QUESTION_CUDA: dict[str, int] = {}


def family(name: str) -> str:
    if name in VIDEO:
        return "tiny-onevision"
    return "tiny-llava" if name in IMAGE_LLM else "tiny-llava-next"


def _site(site: str) -> str:
    """'file (function)' of a counter's or `cuda_sync_sites`' 'path:line (function)'."""
    match = re.match(r"(?:.* at )?(.*):\d+ \((.*)\)$", site)
    return f"{os.path.basename(match.group(1))} ({match.group(2)})" if match else site


def _in_vtoken(site: str) -> bool:
    return f"vtoken{os.sep}" in site.split(" at ")[-1]


def _inputs(name: str, processor, device: str):
    if name in VIDEO:
        inputs = video_inputs(processor, 4)
    else:
        prompt = build_prompt(processor, "what is in the image? answer with one word.")
        inputs = processor(images=[make_image(600, 400)], text=[prompt], return_tensors="pt")
    return inputs.to(device)


def test_the_table_covers_the_registry():
    assert set(READS) == set(vtoken.available_methods()), "a new method needs its row in READS"


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models: dict, name: str, device: str):
    key = (family(name), device)
    if key not in models:
        model, processor = TINY_MODELS[key[0]]()
        models[key] = (model.to(device), processor)
    return models[key]


def _method(name: str, model, device: str = "cpu"):
    extra = CUDA_PARAMS.get(name, {}) if device == "cuda" else {}
    return vtoken.make_method(name, **{**fitting_params(model, name), **PARAMS.get(name, {}), **extra})


def _question(name: str) -> bool:
    return "question" in vtoken.make_method(name, **PARAMS.get(name, {})).requires


@pytest.mark.parametrize("name", sorted(READS))
def test_the_counter_sees_the_documented_reads(models, name):
    """CPU: the launch counter's vtoken sites of a patched generate equal the table; the model's own reads are no
    more than unpatched (the question's host tensors aside, where a method reads the prompt's question)."""
    model, processor = _model(models, name, "cpu")
    inputs = _inputs(name, processor, "cpu")
    with torch.no_grad():
        model.generate(**inputs, **GENERATE)
        with count_launches() as plain:
            model.generate(**inputs, **GENERATE)
        with vtoken.patched(model, _method(name, model)):
            model.generate(**inputs, **GENERATE)  # warm: per-shape caches
            with count_launches() as patched:
                model.generate(**inputs, **GENERATE)
    ours = Counter(_site(s) for s in patched.sync_sites if _in_vtoken(s))
    assert ours == Counter(READS[name]), patched.describe()
    stock = Counter(_site(s) for s in plain.sync_sites)
    theirs = Counter(_site(s) for s in patched.sync_sites if not _in_vtoken(s))
    allowed = stock + Counter(QUESTION_CPU if _question(name) else {})
    assert all(n <= allowed[site] for site, n in theirs.items()), (theirs, stock)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sync debug mode)")
@pytest.mark.parametrize("name", sorted(READS))
def test_patched_generate_on_cuda_syncs_only_where_documented(models, name):
    """CUDA: every real sync of a patched generate (sync debug mode, sites listed) in vtoken's code is one the table
    allows, at most as often; the model's own are no more than unpatched; the warm-up paid every compilation,
    autotuning run and graph capture."""
    model, processor = _model(models, name, "cuda")
    inputs = _inputs(name, processor, "cuda")
    with torch.no_grad():
        model.generate(**inputs, **GENERATE)
        torch.cuda.synchronize()
        with cuda_sync_sites() as plain:
            model.generate(**inputs, **GENERATE)
        with vtoken.patched(model, _method(name, model, "cuda")):
            vtoken.warmup(model, inputs, lengths=[inputs["input_ids"].shape[1]], measure=False, max_new_tokens=3)
            torch.cuda.synchronize()
            with count_events() as events, cuda_sync_sites() as patched:
                model.generate(**inputs, **GENERATE)
    allowed = Counter(READS[name]) + Counter(QUESTION_CUDA if _question(name) else {})
    ours = Counter(_site(s) for s in patched if _in_vtoken(s))
    assert all(n <= allowed[site] for site, n in ours.items()), (ours, allowed)
    theirs = Counter(_site(s) for s in patched if not _in_vtoken(s))
    stock = Counter(_site(s) for s in plain)
    assert all(n <= stock[site] for site, n in theirs.items()), (theirs, stock)
    assert not events.events, events.describe()
