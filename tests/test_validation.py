"""Every method checks its parameters at construction (issue 16, item 9): types, ranges, NaN, bools passed as
numbers, each refused with a `VTokenError` naming the parameter, the value and what is accepted."""

import math

import numpy as np
import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.zoo import build_prompt, tiny_llava

NAN, INF = math.nan, math.inf

# (method, parameters, words the message must contain)
BAD = [
    # MustDrop
    ("mustdrop", dict(key_rate="x"), ["key_rate='x'", "(0, 1]"]),
    ("mustdrop", dict(key_rate=0), ["key_rate=0", "(0, 1]"]),
    ("mustdrop", dict(key_rate=NAN), ["key_rate=nan", "(0, 1]"]),
    ("mustdrop", dict(key_rate=True), ["key_rate=True", "(0, 1]"]),
    ("mustdrop", dict(layers=0), ["layers=0", "ascending tuple of LLM layer indices"]),
    ("mustdrop", dict(layers="2,6"), ["layers='2,6'", "layer indices"]),
    ("mustdrop", dict(layers=(True, 3)), ["layers=(True, 3)", "layer indices"]),
    ("mustdrop", dict(layers=(2.0, 3)), ["layers=(2.0, 3)", "layer indices"]),
    ("mustdrop", dict(layers=()), ["layers=()", "non-empty"]),
    ("mustdrop", dict(layers=(6, 2)), ["layers=(6, 2)", "strictly ascending"]),
    ("mustdrop", dict(merge_threshold="x"), ["merge_threshold='x'", "finite number"]),
    ("mustdrop", dict(merge_threshold=NAN), ["merge_threshold=nan", "finite number"]),
    ("mustdrop", dict(merge_threshold=True), ["merge_threshold=True", "finite number"]),
    ("mustdrop", dict(global_thr=NAN), ["global_thr=nan", "[0, 1]"]),
    ("mustdrop", dict(global_thr=-0.1), ["global_thr=-0.1", "[0, 1]"]),
    ("mustdrop", dict(global_thr="0.001"), ["global_thr='0.001'", "[0, 1]"]),
    ("mustdrop", dict(individual_thr=NAN), ["individual_thr=nan", "[0, 1]"]),
    ("mustdrop", dict(individual_thr=True), ["individual_thr=True", "[0, 1]"]),
    ("mustdrop", dict(individual_thr=2), ["individual_thr=2", "[0, 1]"]),
    ("mustdrop", dict(positions="x"), ["positions='x'", "renumber, original"]),
    # Random
    ("random", dict(seed="x"), ["seed='x'", "an int >= 0"]),
    ("random", dict(seed=1.5), ["seed=1.5", "an int >= 0"]),
    ("random", dict(seed=2.0), ["seed=2.0", "an int >= 0"]),
    ("random", dict(seed=True), ["seed=True", "an int >= 0"]),
    ("random", dict(seed=-1), ["seed=-1", "an int >= 0"]),
    ("random", dict(seed=2**70), ["seed=", "an int >= 0"]),
    ("random", dict(scope="frame"), ["scope='frame'", "crop, image"]),
    # MMTok
    ("mmtok", dict(alpha="x"), ["alpha='x'", ">= 0"]),
    ("mmtok", dict(alpha=NAN), ["alpha=nan", ">= 0"]),
    ("mmtok", dict(alpha=INF), ["alpha=inf", ">= 0"]),
    ("mmtok", dict(alpha=-1), ["alpha=-1", ">= 0"]),
    ("mmtok", dict(alpha=True), ["alpha=True", ">= 0"]),
    ("mmtok", dict(tau_tv=0), ["tau_tv=0", "> 0"]),
    ("mmtok", dict(tau_tv="x"), ["tau_tv='x'", "> 0"]),
    ("mmtok", dict(tau_tv=INF), ["tau_tv=inf", "> 0"]),
    ("mmtok", dict(tau_vv=NAN), ["tau_vv=nan", "> 0"]),
    ("mmtok", dict(tau_vv=True), ["tau_vv=True", "> 0"]),
    ("mmtok", dict(question=3), ["question=3", "non-empty string"]),
    ("mmtok", dict(question=""), ["question=''", "non-empty string"]),
    ("mmtok", dict(question=[]), ["question=[]", "non-empty string"]),
    ("mmtok", dict(question=["a?", 3]), ["question=['a?', 3]", "non-empty string"]),
    ("mmtok", dict(text="x"), ["text='x'", "auto, keywords, question"]),
    ("mmtok", dict(text=None), ["text=None", "auto"]),
    ("mmtok", dict(scope="image"), ["scope='image'", "crop"]),
    # HiRED
    ("hired", dict(rate="x"), ["rate='x'", "(0, 1]"]),
    ("hired", dict(rate=NAN), ["rate=nan", "(0, 1]"]),
    ("hired", dict(rate=50), ["count 50", "fraction in (0, 1]"]),
    ("hired", dict(alpha="x"), ["alpha='x'", "[0, 1]"]),
    ("hired", dict(alpha=NAN), ["alpha=nan", "[0, 1]"]),
    ("hired", dict(alpha=True), ["alpha=True", "[0, 1]"]),
    ("hired", dict(alpha=1.5), ["alpha=1.5", "[0, 1]"]),
    ("hired", dict(partition="rows"), ["partition='rows'", "bands, tiles"]),
    ("hired", dict(partition=None), ["partition=None", "bands, tiles"]),
    ("hired", dict(layer_early="x"), ["layer_early='x'", "vision-tower layer index"]),
    ("hired", dict(layer_early=1.5), ["layer_early=1.5", "vision-tower layer index"]),
    ("hired", dict(layer_early=True), ["layer_early=True", "vision-tower layer index"]),
    ("hired", dict(layer_final="x"), ["layer_final='x'", "vision-tower layer index"]),
    ("hired", dict(scope="crop"), ["scope='crop'", "image"]),
    # Fourier-VLM
    ("fourier", dict(reserve=12.0), ["reserve=12.0", "an int >= 1"]),
    ("fourier", dict(reserve=0), ["reserve=0", "an int >= 1"]),
    ("fourier", dict(reserve=True), ["reserve=True", "an int >= 1"]),
    ("fourier", dict(reserve="12"), ["reserve='12'", "an int >= 1"]),
    ("fourier", dict(ratio="x"), ["ratio='x'", "(0, 1]"]),
    ("fourier", dict(ratio=True), ["ratio=True", "(0, 1]"]),
    ("fourier", dict(ratio=0), ["ratio=0", "(0, 1]"]),
    ("fourier", dict(ratio=NAN), ["ratio=nan", "(0, 1]"]),
    ("fourier", dict(ratio=1.5), ["ratio=1.5", "(0, 1]"]),
    ("fourier", dict(scope="image"), ["scope='image'", "crop"]),
    # FastV
    ("fastv", dict(layer="2"), ["layer='2'", "an int >= 0 (an LLM layer index)"]),
    ("fastv", dict(layer=-1), ["layer=-1", "an int >= 0 (an LLM layer index)"]),
    ("fastv", dict(layer=True), ["layer=True", "an int >= 0 (an LLM layer index)"]),
    ("fastv", dict(layer=2.0), ["layer=2.0", "an int >= 0 (an LLM layer index)"]),
    ("fastv", dict(positions="kept"), ["positions='kept'", "original, renumber"]),
    # FasterVLM and pool
    ("fastervlm", dict(scope=None), ["scope=None", "crop, image"]),
    ("fastervlm", dict(scope=["crop"]), ["scope=['crop']", "crop, image"]),
    ("pool", dict(scope="image"), ["scope='image'", "crop"]),
]


@pytest.mark.parametrize("name, params, words", BAD, ids=[f"{n}-{p}" for n, p, _ in BAD])
def test_bad_parameters_are_refused_at_construction(name, params, words):
    with pytest.raises(vtoken.VTokenError) as err:
        vtoken.make_method(name, **params)
    message = str(err.value)
    assert message.startswith(name + ":") or name in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    "name, params",
    [
        ("fastv", dict(keep="x")),
        ("fastv", dict(keep=0)),
        ("fastv", dict(keep=NAN)),
        ("fastv", dict(keep=True)),
        ("mmtok", dict(budget=INF)),
        ("fourier", dict(budget=-1)),
    ],
)
def test_bad_budgets_are_budget_errors(name, params):
    with pytest.raises(vtoken.BudgetError, match=r"\(0, 1\]"):
        vtoken.make_method(name, **params)


def test_accepted_values_are_kept_and_normalised():
    """Edge values inside the ranges pass, numpy numbers become Python ones, lists of layers become tuples."""
    assert vtoken.Random(seed=np.int64(3)).seed == 3 and type(vtoken.Random(seed=np.int64(3)).seed) is int
    assert vtoken.MustDrop(layers=[0, 2]).layers == (0, 2)
    assert vtoken.MustDrop(layers=np.array([1, 3]).tolist(), merge_threshold=1.01).merge_threshold == 1.01
    assert vtoken.MustDrop(global_thr=0, individual_thr=1).individual_thr == 1.0
    assert vtoken.MustDrop(key_rate=1).key_rate == 1.0
    assert vtoken.HiRED(alpha=0).alpha == 0.0 and vtoken.HiRED(alpha=1, rate=1.0).rate == 1.0
    assert vtoken.HiRED(layer_early=-1, layer_final=np.int64(2)).requires == ("cls_attention@-1", "cls_attention@2")
    assert vtoken.MMTok(alpha=0, tau_tv=0.5, question=("a?", "b?")).question == ["a?", "b?"]
    assert vtoken.FourierDCT(reserve=np.int64(6), ratio=1).reserve == 6
    assert vtoken.FastV(layer=np.int64(0), keep=3).layer == 0


def _hooks(model) -> dict:
    """Every forward (pre-)hook of every module (transformers adds its own at a model's first call)."""
    return {n: (list(m._forward_pre_hooks.values()), list(m._forward_hooks.values())) for n, m in model.named_modules()}


def _untouched(model, hooks: dict):
    assert vtoken.handle_of(model) is None and "generate" not in model.__dict__
    assert _hooks(model) == hooks


def test_mustdrop_on_a_grid_its_windows_do_not_tile_is_refused_at_patch():
    """A 20x20 patch grid cannot be cut into 3x3 windows: refused at `patch` (not at the first call), model intact."""
    model, processor = tiny_llava(image_size=320, patch_size=16)
    hooks = _hooks(model)
    with pytest.raises(vtoken.VTokenError, match="20x20 patch grid cannot be cut into 3x3 windows"):
        vtoken.patch(model, vtoken.MustDrop(layers=(0,)))
    _untouched(model, hooks)
    inputs = processor(images=[make_image(64, 48)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with torch.no_grad():
        assert model(**inputs).logits.isfinite().all()  # and the model still runs as before


@pytest.mark.parametrize("layout", ["official", 5, None])
def test_patch_refuses_a_layout_the_family_lacks(llava, layout):
    hooks = _hooks(llava[0])
    with pytest.raises(vtoken.VTokenError, match="layout=.*it has: native"):
        vtoken.patch(llava[0], "random", layout=layout)
    _untouched(llava[0], hooks)
