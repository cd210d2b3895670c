"""Third-party methods (issue 35). Two methods outside vtoken, written with its public API only
(tests/plugin_methods.py): `plugin_norm`, defined in a test module and registered at run time, and `plugin_cls`,
installed through a tiny distribution's `vtoken.methods` entry point (built here into a folder on sys.path), each
pass through `vtoken.patch` on every built-in family whose signals it needs (a clear refusal elsewhere),
`applicable_methods`, `vtoken run --method ... --param ...`, the demo, `vtoken eval` and the vLLM plugin (served
when its count is known before encoding, refused with the reason otherwise). A name clash with a built-in is an
error naming both. The method modules never import the registry; every built-in declares every parameter.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import captured_llm_input, inputs_for
from plugin_methods import ENTRY_POINT, PACKAGE, NormPrune, build_distribution, register

import vtoken
import vtoken.methods
from vtoken import registry
from vtoken.zoo import BUILTIN_MODELS, MINI

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("plugin_norm", ENTRY_POINT)


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """Both plugin methods known to vtoken: `plugin_norm` registered, the distribution's folder on sys.path (its
    entry point found by a refresh, as after `pip install` in a running process); both forgotten after."""
    folder = build_distribution(tmp_path_factory.mktemp("dist"))
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    register()
    registry.load_methods(refresh=True)
    yield folder
    for name in NAMES:
        if name in vtoken.available_methods():
            vtoken.unregister_method(name)
    sys.path.remove(str(folder))
    for module in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[module]


def test_the_entry_point_is_listed_and_imported_only_when_used(plugins):
    assert set(NAMES) <= set(vtoken.available_methods())
    assert f"{PACKAGE}.prune" not in sys.modules  # listed from its metadata, not imported
    cls = registry.method_class("Plugin-CLS")  # case, '-' and '_' ignored, as for the built-ins
    assert cls.name == ENTRY_POINT and cls.__module__ == f"{PACKAGE}.prune"
    assert registry.method_class("plugin_norm") is NormPrune


# ----------------------------------------------------------------- the registry and the declarations
def test_the_methods_never_import_the_registry():
    """One-way: the registry imports the methods (lazily), no method module imports the registry."""
    for path in sorted((ROOT / "vtoken" / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "registry" not in (node.module or "") and "registry" not in [a.name for a in node.names], path
    code = "import sys, vtoken.methods; assert 'vtoken.registry' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_every_builtin_declares_every_parameter():
    from vtoken.params import Param

    exports = [getattr(vtoken.methods, n) for n in vtoken.methods.__all__]
    builtins = [cls for cls in exports if getattr(cls, "name", "")]  # (not TowerShape, a method's description)
    assert {cls.name for cls in builtins} <= set(vtoken.available_methods())
    for cls in builtins:
        registry.check_declaration(cls)
        declared = cls.declared_params()
        assert set(declared) == set(cls.defaults()), (cls.name, set(cls.defaults()) ^ set(declared))
        assert all(isinstance(spec, Param) and spec.text() for spec in declared.values()), cls.name
        cls()  # the defaults pass their own declarations


def test_declarations_drive_validation(plugins):
    with pytest.raises(vtoken.VTokenError, match=r"plugin_norm: power=0 \(int\); expected a number > 0"):
        NormPrune(power=0)
    with pytest.raises(vtoken.VTokenError, match=r"plugin_cls: mix=2.*\[0, 1\].*feature norm"):
        vtoken.make_method(ENTRY_POINT, mix=2.0)
    with pytest.raises(vtoken.BudgetError, match="plugin_norm: budget"):
        vtoken.make_method("plugin_norm", budget=0)
    with pytest.raises(vtoken.VTokenError, match="scope='frame'; accepted: crop, image"):
        NormPrune(scope="frame")


def test_a_name_clash_is_an_error_naming_both(plugins, tmp_path):
    @dataclass
    class Impostor(vtoken.ScoreMethod):
        name = "fastv"

    with pytest.raises(vtoken.VTokenError) as err:
        vtoken.register_method(Impostor)
    assert (
        "'fastv'" in str(err.value) and "Impostor" in str(err.value) and "vtoken.methods.fastv.FastV" in str(err.value)
    )
    Impostor.name = "plugin_norm"  # another method's name: refused, naming both
    with pytest.raises(vtoken.VTokenError, match="Impostor.*plugin_methods.NormPrune"):
        vtoken.register_method(Impostor)
    assert vtoken.register_method(NormPrune) is NormPrune  # the same class again: fine (a re-run, a reload)

    # an installed package whose entry point takes a built-in's name
    clash = build_distribution(tmp_path / "clash", name="pool", package="vtoken_plugin_clash")
    sys.path.insert(0, str(clash))
    importlib.invalidate_caches()
    try:
        with pytest.raises(vtoken.VTokenError) as err:
            registry.load_methods(refresh=True)
        message = str(err.value)
        assert "'pool'" in message and "vtoken_plugin_clash.prune:ClsKeep" in message
        assert "vtoken.methods.pool.Pool" in message
    finally:
        sys.path.remove(str(clash))
        importlib.invalidate_caches()
    registry.load_methods(refresh=True)  # the package gone: fine again
    assert registry.method_class("pool") is vtoken.Pool

    with pytest.raises(vtoken.VTokenError, match="not a dataclass"):

        class Undecorated(vtoken.ScoreMethod):
            name = "plugin_bare"

        vtoken.register_method(Undecorated)


# ----------------------------------------------------------------- vtoken.patch and applicable_methods
@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_patch_on_every_family_whose_signals_it_needs(plugins, name):
    """`plugin_norm` (the features' norm: every family provides them) applies everywhere and keeps what a built-in
    per-crop budget keeps (Random's counts); `plugin_cls` applies where the model has [CLS] attention and is
    refused elsewhere with `patch`'s own error, naming the method and the signal, the model left unpatched."""
    from vtoken.demo import app, runs
    from vtoken.images import example_image

    model, processor = app.get_model(name)
    view = vtoken.model_view(model)
    verdicts = vtoken.applicable_methods(model)
    inputs = runs.prepare_inputs(model, processor, "what is it?", example_image(200))
    counts = {}
    for method in ("random", "plugin_norm", ENTRY_POINT):
        if method == ENTRY_POINT and "cls_attention" not in view.signals:
            reason = verdicts[method]
            assert reason is not None and "plugin_cls" in reason and "cls_attention" in reason, reason
            with pytest.raises(vtoken.MissingSignalError) as err:
                vtoken.patch(model, method)
            assert str(err.value) == reason and vtoken.handle_of(model) is None
            continue
        assert verdicts[method] is None, (name, method, verdicts[method])
        with torch.no_grad(), vtoken.patched(model, method, budget=0.25) as handle:
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            encoder = [r for r in handle.records if r.stage == "encoder"]
        assert encoder and {r.method for r in encoder} == {method}
        counts[method] = [(r.crop, r.tokens_in, r.tokens_out) for r in encoder]
    assert counts["plugin_norm"] == counts["random"], name
    if ENTRY_POINT in counts:
        assert counts[ENTRY_POINT] == counts["random"], name


def test_the_selection_is_the_methods_own(plugins, llava, photos):
    """On LLaVA-1.5: the kept tokens are the top-k feature norms of the tower's feature layer, computed here by
    hand, and the LLM receives exactly the unpatched model's embeddings of those tokens."""
    model, processor = llava
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is in the image?"])
    with torch.no_grad():
        hidden = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states
    features = hidden[model.config.vision_feature_layer][0, 1:]  # [CLS] dropped ("default" strategy)
    k = vtoken.tokens_to_keep(0.1, len(features))
    expected = features.norm(p=1.0, dim=-1).topk(k).indices.sort().values
    unpatched = captured_llm_input(model, inputs)
    with vtoken.patched(model, "plugin_norm", budget=0.1, power=1.0) as handle:
        patched = captured_llm_input(model, inputs)
        (record,) = handle.records
    assert record.kept.tolist() == expected.tolist()
    image = inputs["input_ids"][0] == model.config.image_token_id
    start = int(image.nonzero()[0])
    torch.testing.assert_close(patched[0, start : start + k], unpatched[0, image][expected], rtol=0, atol=1e-6)


# ----------------------------------------------------------------- the CLI, the demo, vtoken eval
def test_vtoken_run_and_list(plugins, capsys):
    from vtoken.cli import main

    assert main(["run", "--model", "tiny-llava", "--method", "plugin_norm", "--param", "power=1", "--budget", "0.1",
                 "--max-new-tokens", "2", "--repeats", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "method:  plugin_norm(budget=10%, power=1)" in out and "576 -> 58 (10.1% kept)" in out, out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "plugin_norm (encoder): budget, scope, power; --budget sets budget" in out
    assert "plugin_cls (encoder): budget, scope, mix; --budget sets budget" in out
    assert main(["run", "--method", "plugin_norm", "--param", "power=-1"]) == 2  # refused before loading
    assert "plugin_norm: power=-1" in capsys.readouterr().err


def test_vtoken_run_finds_the_installed_method_in_a_fresh_process(plugins):
    env = {**__import__("os").environ, "PYTHONPATH": str(plugins), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "vtoken.cli", "run", "--model", "tiny-llava", "--method", "plugin-cls",
                           "--param", "mix=0.5", "--max-new-tokens", "2", "--repeats", "1"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "method:  plugin_cls(budget=25%, mix=0.5)" in done.stdout and "576 -> 144" in done.stdout, done.stdout


def test_demo_offers_and_runs_them(plugins, monkeypatch):
    from vtoken.demo import app, controls
    from vtoken.images import example_image

    monkeypatch.setattr(app, "_OFFERED", {})  # what the page offers, computed again with the plugins registered
    specs = controls.control_specs()
    mine = {(c.method, c.param): c.kind for c in specs if c.method in NAMES}
    assert mine == {("plugin_norm", "budget"): "budget", ("plugin_norm", "scope"): "choice",
                    ("plugin_norm", "power"): "float", (ENTRY_POINT, "budget"): "budget",
                    (ENTRY_POINT, "scope"): "choice", (ENTRY_POINT, "mix"): "float"}  # fmt: skip
    state = app.model_state(MINI)
    assert set(NAMES) <= set(state["methods"])
    defaults = state["defaults"]
    assert defaults["plugin_norm"]["budget"] == 0.25 and defaults[ENTRY_POINT]["mix"] == 0.0
    values = []
    for c in specs:
        value = defaults.get(c.method, {}).get(c.param)
        value = ", ".join(map(str, value)) if c.kind in controls.LISTS else value
        values.append({"optional_int": 0, "optional_float": 0, "free": ""}.get(c.kind, value))
    values[specs.index(next(c for c in specs if (c.method, c.param) == ("plugin_norm", "power")))] = 1.0
    result = app.run_comparison(MINI, "image", example_image(200), None, 2, "what is it?", list(NAMES), [], "native",
                                1, 2, values)  # fmt: skip
    labels = [row[0] for row in result["rows"]]
    assert labels == ["unpatched", "plugin_norm(budget=25%, power=1)", "plugin_cls(budget=25%)"], labels
    assert [c.llm_input for c in result["counts"]] == [144, 36, 36]
    assert len(result["pictures"]) == 3
    pytest.importorskip("gradio")
    app.build_demo(MINI)  # the page, with their controls


def test_vtoken_eval_sweeps_them(plugins, tmp_path, monkeypatch):
    from vtoken.cli import main

    monkeypatch.setenv("VTOKEN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sweep"
    assert main(["eval", "--model", "vtoken-mini", "--methods", f"plugin_norm,{ENTRY_POINT}", "--budgets", "0.25",
                 "--param", "plugin_norm.power=1", "--limit", "4", "--batch-size", "4", "--repeats", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    report = json.loads((out / "sweep.json").read_text())
    assert [s["method"] for s in report["settings"]] == ["none", "plugin_norm", ENTRY_POINT]
    assert [s["means"]["vtoken_visual_kept"] for s in report["settings"]] == [144, 36, 36]


# ----------------------------------------------------------------- the vLLM plugin
def test_vllm_serves_them_when_their_count_is_known_before_encoding(plugins, tmp_path):
    """In vLLM (the vllm venv): the installed method (found through its entry point) and the registered one
    (registered by the driver before the engines, as a user's script) give `vtoken.patch`'s greedy ids and
    logprobs; the registered one with scope='image' (its count decided by the data) is refused at start."""
    from vllm_support import (
        QUESTIONS,
        assert_same,
        images,
        prompt,
        reference,
        run_driver,
        save_checkpoints,
        vllm_python,
    )

    vllm_python()
    model = save_checkpoints(tmp_path, ("llava",))["llava"]
    pictures = images(tmp_path)
    requests = [{"prompt": prompt("llava", q), "images": [str(p)]} for q, p in zip(QUESTIONS, pictures, strict=True)]
    served = [(ENTRY_POINT, {"budget": 0.25, "mix": 0.5}), ("plugin_norm", {"budget": 0.25, "power": 1})]
    engines = [{"model": str(model), "override": {"method": m, **p}, "requests": requests} for m, p in served]
    engines.append({"model": str(model), "override": {"method": "plugin_norm", "scope": "image"}, "requests": []})
    job = {"engines": engines, "sys_path": [str(plugins), str(ROOT / "tests")], "setup": ["plugin_methods:register"]}
    results = run_driver(job, tmp_path)
    for (method, params), result in zip(served, results, strict=False):
        assert "error" not in result, result
        for (question, picture), got in zip(zip(QUESTIONS, pictures, strict=True), result["results"], strict=True):
            assert_same(got, reference(model, "llava", method, params, question, picture))
    refusal = results[-1]["error"]
    assert "vtoken" in refusal and "plugin_norm" in refusal and "from the data" in refusal, refusal
