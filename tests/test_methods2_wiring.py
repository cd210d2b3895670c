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
        assert method_params(name, 0.1) == {"budget": 0.1}
    with pytest.raises(vtoken.VTokenError, match="either the budget"):
        build_methods("visionzip", {"budget": 64, "dominant": 54}, [])
