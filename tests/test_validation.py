"""Parameter values at their edges: accepted values are kept and normalised (numpy numbers, lists of layers), a
grid MustDrop's windows do not tile and a layout the family lacks are refused at `patch`, the model intact. (Every
declared parameter's bad values, refused at construction naming the parameter, the value and what is accepted:
tests/test_contract.py.)"""

import numpy as np
import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.zoo import build_prompt, tiny_llava


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
