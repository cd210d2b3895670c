"""VisionZip, VisPruner, DivPrune and VidCom2 wired into the rest of vtoken: the method x family table of
docs/methods-encoder-2.md as `applicable_methods` verdicts on every tiny model, `planned_count` before the encoder,
`vtoken eval` / lmms-eval model arguments and the CLI's budget flag."""

import pytest

import vtoken
from vtoken.applicability import applicable_methods
from vtoken.cli import method_params
from vtoken.eval.options import build_methods
from vtoken.eval.sweep import settings
from vtoken.zoo import TINY_MODELS

NO_CLS = {"tiny-onevision", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5",
          "tiny-qwen3.5-moe", "tiny-gemma3", "tiny-fastvlm"}  # fmt: skip
IMAGES_ONLY = {"tiny-llava", "tiny-llava-next", "tiny-gemma3", "tiny-fastvlm"}


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_family_table(name):
    model, _ = TINY_MODELS[name]()
    verdicts = applicable_methods(model)
    assert (verdicts["visionzip"] is None) == (name not in NO_CLS), verdicts["visionzip"]
    assert (verdicts["vispruner"] is None) == (name not in NO_CLS), verdicts["vispruner"]
    assert verdicts["divprune"] is None, verdicts["divprune"]
    assert (verdicts["vidcom2"] is None) == (name not in IMAGES_ONLY), verdicts["vidcom2"]
    if name in NO_CLS:
        assert "cls_attention" in verdicts["visionzip"] and "cls_attention" in verdicts["vispruner"]
    if name in IMAGES_ONLY:
        assert "video inputs only" in verdicts["vidcom2"]


def test_planned_counts_are_known_before_the_encoder_where_the_data_does_not_decide():
    assert vtoken.VisionZip().planned_count(576) == 64 and vtoken.VisionZip(budget=0.25).planned_count(576) == 144
    assert vtoken.VisPruner().planned_count(576) == 64 and vtoken.VisPruner(budget=0.5).planned_count(10) == 5
    assert vtoken.DivPrune().planned_count(576) == 56  # of the image's placed tokens (placeholders)
    assert vtoken.VidCom2().planned_count(196) is None  # frame budgets follow the frames' uniqueness


def test_eval_and_cli_take_them_by_name():
    (zipped,) = build_methods("visionzip", {"dominant": 108, "contextual": 20}, [])
    assert (zipped.dominant, zipped.contextual) == (108, 20)
    pruner, fastv = build_methods("vispruner+fastv", {"budget": 128, "important_ratio": 0.25, "keep": 0.5}, [])
    assert (pruner.budget, pruner.important_ratio, fastv.keep) == (128, 0.25, 0.5)
    points = settings(["visionzip", "divprune", "vidcom2"], [64, 0.25], {})
    assert [(p.method, p.budget) for p in points][1:] == [(m, b) for m in ("visionzip", "divprune", "vidcom2")
                                                          for b in (64, 0.25)]  # fmt: skip
    assert build_methods("visionzip", {"budget": 64}, [])[0].split(576) == (54, 10)
    for name in ("visionzip", "vispruner", "divprune", "vidcom2"):
        assert method_params(name, 0.1) == {f"{name}.budget": 0.1}
    # VisionZip's dominant/contextual stand for its budget: the CLI's default budget is not added beside them
    assert method_params("visionzip", None, ["dominant=108", "contextual=20"]) == {"dominant": 108, "contextual": 20}
    assert method_params("visionzip", None) == {"visionzip.budget": 0.25}
    with pytest.raises(vtoken.VTokenError, match="either the budget"):
        build_methods("visionzip", {"budget": 64, "dominant": 54}, [])


def test_the_functional_api_runs_them_on_a_bare_tower(llava, photos):
    """`vtoken.encode` gives the [CLS] row and the keys of a CLIP tower's block; `vtoken.select` runs VisionZip,
    VisPruner and DivPrune on them exactly as `vtoken.patch` does on the model; VidCom2 needs videos."""
    import torch
    from conftest import inputs_for
    from test_visionzip import _eager_signals, reference

    model, processor = llava
    pixel_values = inputs_for(processor, [photos["rocket"]], ["what?"])["pixel_values"]
    tower = model.model.vision_tower
    with torch.no_grad():
        features, signals = vtoken.encode(tower, pixel_values, layer=-2, signals=("cls_attention", "keys"))
    scores, keys, patches, _ = _eager_signals(tower, pixel_values)
    torch.testing.assert_close(signals["keys"], keys, rtol=1e-5, atol=1e-5)
    merged, index = vtoken.select(vtoken.VisionZip(dominant=12, contextual=4), features, signals=signals)
    rows, _ = reference(scores[0], keys[0], patches[0], None, 12, 4)
    assert index is None and merged.shape == (1, 16, features.shape[-1])
    torch.testing.assert_close(merged[0], rows, rtol=1e-4, atol=1e-5)
    kept, index = vtoken.select(vtoken.VisPruner(budget=20), features, signals=signals)
    with torch.no_grad(), vtoken.patched(model, vtoken.VisPruner(budget=20)) as handle:
        model(**inputs_for(processor, [photos["rocket"]], ["what?"]))
    assert index[0].tolist() == handle.records[0].kept.tolist()
    _, index = vtoken.select(vtoken.DivPrune(budget=9), features)
    assert index.shape == (1, 9)
    with pytest.raises(vtoken.VTokenError, match="vidcom2 acts on videos"):
        vtoken.select(vtoken.VidCom2(), features)
    with pytest.raises(vtoken.InputError, match=r"signals\['keys'\].*\[B, N, d\]"):
        vtoken.select(vtoken.VisionZip(), features, signals={**signals, "keys": signals["cls_attention"]})
