"""CDPruner and HoloV wired into the rest of vtoken: docs/guide/methods.md's family tables as `applicable_methods`
verdicts on every tiny model (with the labelled variants `fitting_params` picks where the official signal is
missing), `vtoken eval` / lmms-eval model arguments, the CLI and the demo's controls."""

import pytest

import vtoken
from vtoken.applicability import applicable_methods, fitting_params
from vtoken.cli import main, method_params
from vtoken.demo import controls
from vtoken.eval.options import build_methods
from vtoken.eval.sweep import settings
from vtoken.zoo import TINY_MODELS

QWEN_TOWERS = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5",
               "tiny-qwen3.5-moe"}  # fmt: skip
NO_CLS = QWEN_TOWERS | {"tiny-onevision", "tiny-gemma3", "tiny-fastvlm"}
CLIP_FAMILIES = {"tiny-llava", "tiny-llava-next", "tiny-llava-next-video"}  # a CLIP tower whose width a CLIP fits


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_family_table(name):
    model, _ = TINY_MODELS[name]()
    verdicts = applicable_methods(model)
    # CDPruner: everywhere, as CDPruner-LLM where the official CLIP relevance cannot apply (the tiny towers' width
    # is not CLIP-L's, and most families have no CLIP text tower at all)
    assert verdicts["cdpruner"] is None and fitting_params(model, "cdpruner") == {"relevance": "llm"}
    # HoloV: [CLS] attention where there is a [CLS]; the received attention as the opt-in on towers without it
    # (every tower whose attention vtoken reads: not FastVLM's)
    assert (verdicts["holov"] is None) == (name != "tiny-fastvlm"), verdicts["holov"]
    assert fitting_params(model, "holov") == ({"score": "received"} if name in NO_CLS - {"tiny-fastvlm"} else {})
    if name == "tiny-fastvlm":
        assert "cls_attention" in verdicts["holov"] and "score='received'" in verdicts["holov"]
    with pytest.raises(vtoken.VTokenError, match="relevance='llm'"):  # the official default, refused with the way
        vtoken.patch(model, "cdpruner")


def test_eval_and_cli_take_them_by_name():
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
