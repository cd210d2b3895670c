"""Methods reach the tools by name: `vtoken eval` / lmms-eval model arguments and sweeps, the CLI's `--method`,
`--budget` and `--param`, the demo's controls, `vtoken.select` on a bare tower, counts planned before the encoder,
and the labelled variants `fitting_params` picks where an official signal is missing (VisionZip, VisPruner,
DivPrune, VidCom2, CDPruner, HoloV). Where each method applies on each family: tests/test_contract.py."""

import pytest

import vtoken
from vtoken.applicability import applicable_methods, fitting_params
from vtoken.cli import main, method_params
from vtoken.demo import controls
from vtoken.eval.options import build_methods
from vtoken.eval.sweep import settings
from vtoken.zoo import TINY_MODELS


def test_planned_counts_are_known_before_the_encoder_where_the_data_does_not_decide():
    assert vtoken.VisionZip().planned_count(576) == 64 and vtoken.VisionZip(budget=0.25).planned_count(576) == 144
    assert vtoken.VisPruner().planned_count(576) == 64 and vtoken.VisPruner(budget=0.5).planned_count(10) == 5
    assert vtoken.DivPrune().planned_count(576) == 56  # of the image's placed tokens (placeholders)
    assert vtoken.VidCom2().planned_count(196) is None  # frame budgets follow the frames' uniqueness


def test_visionzip_vispruner_divprune_vidcom2_reach_eval_and_the_cli():
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


QWEN_TOWERS = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5",
               "tiny-qwen3.5-moe"}  # fmt: skip
NO_CLS = QWEN_TOWERS | {"tiny-onevision", "tiny-gemma3", "tiny-fastvlm"}  # towers without a [CLS] token


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_cdpruner_and_holov_fit_their_labelled_variants_where_the_official_signal_is_missing(name):
    """CDPruner-LLM (`relevance="llm"`) everywhere on the tiny models (their towers' width is not CLIP-L's, most
    families have no CLIP text tower), HoloV's received attention on every tower without [CLS] whose attention
    vtoken reads (not FastVLM's: HoloV is refused there, naming score='received'); the official CDPruner is
    refused naming the variant. (Where each applies: tests/test_contract.py checks the docs' tables.)"""
    model, _ = TINY_MODELS[name]()
    assert fitting_params(model, "cdpruner") == {"relevance": "llm"}
    assert fitting_params(model, "holov") == ({"score": "received"} if name in NO_CLS - {"tiny-fastvlm"} else {})
    if name == "tiny-fastvlm":
        verdict = applicable_methods(model)["holov"]
        assert "cls_attention" in verdict and "score='received'" in verdict, verdict
    with pytest.raises(vtoken.VTokenError, match="relevance='llm'"):  # the official default, refused with the way
        vtoken.patch(model, "cdpruner")


def test_cdpruner_and_holov_reach_eval_and_the_cli():
    cdpruner, fastv = build_methods("cdpruner+fastv", {"budget": 128, "relevance": "llm", "keep": 0.5}, [])
    assert (cdpruner.budget, cdpruner.relevance, fastv.keep) == (128, "llm", 0.5)
    (holov,) = build_methods("holov", {"budget": 64, "chunks": "auto"}, [])
    assert (holov.budget, holov.chunks) == (64, "auto")
    points = settings(["cdpruner", "holov"], [64, 0.25], {})
    assert [(p.method, p.budget) for p in points][1:] == [(m, b) for m in ("cdpruner", "holov") for b in (64, 0.25)]
    for name in ("cdpruner", "holov"):
        assert method_params(name, 0.1) == {f"{name}.budget": 0.1}
    assert method_params("cdpruner", None, ["relevance=llm", "theta=0.5"]) == {
        "cdpruner.budget": 0.25, "relevance": "llm", "theta": 0.5,
    }  # fmt: skip


def test_the_cli_runs_them_on_vtoken_mini(capsys):
    assert main(["run", "--method", "holov", "--budget", "36"]) == 0
    assert "holov" in capsys.readouterr().out
    assert main(["run", "--method", "cdpruner", "--budget", "36", "--param", "relevance=llm"]) == 0


def test_the_demo_offers_their_knobs():
    specs = {(c.method, c.param): c.kind for c in controls.control_specs()}
    assert specs[("cdpruner", "relevance")] == "choice" and specs[("holov", "score")] == "choice"
    assert specs[("holov", "chunks")] == "count" and specs[("cdpruner", "budget")] == "budget"
    model, _ = TINY_MODELS["tiny-qwen2.5-vl"]()
    assert controls.default_params(model, "holov")["score"] == "received"
    assert controls.default_params(model, "cdpruner")["relevance"] == "llm"
