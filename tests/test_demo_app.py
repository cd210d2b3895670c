"""The demo's functions without a browser: which methods it offers, every offered method on every built-in model
(image and video), pictures of what was kept, errors before generation, examples and the budget sweep."""

import numpy as np
import pytest
import torch

import vtoken
from vtoken.applicability import applicable_methods, fitting_params, llm_depth
from vtoken.demo import app, controls, runs, views
from vtoken.images import example_image
from vtoken.registry import available_methods
from vtoken.zoo import BUILTIN_MODELS, MINI


def control_values(model_name: str, budget: float | None = None) -> list:
    """The controls' starting values, as the page shows them for `model_name` (every `budget` set to `budget`)."""
    defaults = app.model_state(model_name)["defaults"]
    values = []
    for control in controls.control_specs():
        value = defaults.get(control.method, {}).get(control.param)
        if control.param == "budget" and budget is not None:
            value = budget
        if control.kind in controls.LISTS:
            value = ", ".join(map(str, value))
        elif control.kind in ("optional_int", "optional_float"):
            value = 0
        elif control.kind == "free":
            value = ""
        values.append(value)
    return values


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_applicable_methods_are_exactly_those_patch_accepts(name):
    model, _ = app.get_model(name)
    verdicts = applicable_methods(model)
    assert sorted(verdicts) == available_methods()
    adapter = vtoken.api._find_adapter(model)
    for method, reason in verdicts.items():
        errors = []
        for layout in adapter.layouts:
            try:
                vtoken.patch(model, method, layout=layout, **fitting_params(model, method))
                vtoken.unpatch(model)
            except vtoken.VTokenError as err:
                errors.append(str(err))
        assert (reason is None) == (len(errors) < len(adapter.layouts)), (name, method, reason, errors)
        if reason is not None:
            assert reason == errors[0]
    if llm_depth(model) < 16 and adapter.family != "gemma3":  # Gemma 3 refuses LLM stages whatever the layer
        assert verdicts["fastv"] is None  # FastV's default layer 2 may not fit; the fitted one applies


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_every_offered_method_runs_on_every_builtin_model(name):
    model, processor = app.get_model(name)
    values = control_values(name, budget=0.05)  # few tokens: MMTok's greedy loop takes one step per kept token
    for kind in app.offered(name):
        methods = app.offered_names(name, kind)
        assert "random" in methods and "pool" in methods
        video = app.load_example("generated clip")["video"] if kind == "video" else None
        result = app.run_comparison(name, kind, example_image(200), video, 2, "what is it?", methods, [], "native",
                                    1, 2, values)  # fmt: skip
        rows, pictures = result["rows"], result["pictures"]
        # a label: "name(params)", with " [layout=...]" where the method takes another layout (a tower method on
        # LLaVA-OneVision, which may have no parameters shown)
        assert [r[0].split(" [")[0].split("(")[0] for r in rows] == ["unpatched", *methods]
        assert len(pictures) == len(rows) and all(p.width > 0 for p, _ in pictures)
        # the answers are the model's own under each configuration, patched by hand
        inputs = runs.prepare_inputs(model, processor, "what is it?", *_input(kind, video))
        configs = app.configurations(
            model, methods, [], "native", controls.method_params(controls.control_specs(), values)
        )
        for row, config in zip(rows[1:], configs, strict=True):
            with torch.inference_mode(), vtoken.patched(model, config.build(), layout=config.layout):
                out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
            text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
            assert row[1] == text.strip(), (name, kind, row[0])
            counts = result["counts"][rows.index(row)]
            assert counts.unpatched == result["counts"][0].unpatched == result["counts"][0].llm_input  # same input
            assert row[4] == counts.text()
            after = counts.inside[-1][1] if counts.inside else counts.llm_input
            if config.methods == ["sparse_prefill"]:  # keeps every token; skips attention work instead
                assert after == counts.unpatched and row[4] == f"all {counts.unpatched} kept", (name, kind, row)
                continue
            if config.methods == ["dycoke"] and getattr(model.config.vision_config, "temporal_patch_size", 1) > 1:
                assert after == counts.unpatched, (name, kind, row)  # the demo's 2 frames: one temporal patch,
                continue  # which DyCoke has no neighbour frame to merge with
            built = config.build()
            sparse = [m for m in (built if isinstance(built, list) else [built]) if m.name == "sparsevlm"]
            if sparse and counts.unpatched <= min(sparse[0].counts) + 1:  # official counts >= a tiny model's
                assert after == counts.unpatched, (name, kind, row)  # tokens: one is dropped and comes back recycled
                continue
            assert after < counts.unpatched, (name, kind, row)  # every other default configuration reduces them
            picture = np.asarray(pictures[rows.index(row)][0], dtype=np.int32)
            unpatched = np.asarray(pictures[0][0], dtype=np.int32)
            drawn = picture.shape == unpatched.shape and np.abs(picture - unpatched).mean() > 1
            # a family added later may lack the LLM-order mapping: then the picture says so instead
            caption = pictures[rows.index(row)][1]
            if family(model) in MAPPED:  # LLM-stage drops drawn on the crops, never skipped
                assert drawn and "cannot be mapped" not in caption, (name, kind, caption)
                prefill = ("fastv", "mustdrop", "dart", "pyramiddrop", "sparsevlm", "prunevid", "framefusion")
                names = [part.strip().split("(")[0] for part in row[0].split("+")]  # fastvid is no fastv
                assert ("surviving the LLM's drops" in caption) == any(m in names for m in prefill)
            else:
                assert drawn or "cannot be mapped" in caption


MAPPED = {"llava-1.5", "llava-next", "llava-next-video", "llava-onevision", "qwen2-vl", "qwen2.5-vl", "video-llava"}


def family(model) -> str:
    return vtoken.api._find_adapter(model).family


def _input(kind, video):
    from vtoken.images import load_video

    return (None, load_video(video, 2)) if kind == "video" else (example_image(200), None)


def test_defaults_fit_the_llm_depth():
    tiny, _ = app.get_model("tiny-llava")  # 2 layers
    mini, _ = app.get_model(MINI)  # 4 layers
    assert fitting_params(tiny, "fastv") == {"layer": 0} and fitting_params(mini, "fastv") == {"layer": 2}
    assert fitting_params(tiny, "mustdrop") == {"layers": (0,)} and fitting_params(mini, "mustdrop") == {"layers": (2,)}
    assert fitting_params(tiny, "dart") == {"layer": 1} and fitting_params(mini, "dart") == {"layer": 2}
    assert fitting_params(mini, "pyramiddrop") == {"layers": (1, 2, 3), "ratios": (0.5, 0.25, 0.125)}
    assert fitting_params(tiny, "pyramiddrop") == {"layers": (1,), "ratios": (0.5,)}
    assert fitting_params(mini, "sparsevlm") == {"layers": (0, 1, 2), "keep": (300, 200, 110)}
    assert fitting_params(tiny, "sparsevlm") == {"layers": (0,), "keep": (110,)}
    for model in (tiny, mini):  # the official layers do not fit; the fitted ones patch
        for name in ("mustdrop", "pyramiddrop", "sparsevlm"):
            with pytest.raises(vtoken.VTokenError, match="layers"):
                vtoken.patch(model, name)
            vtoken.patch(model, name, **fitting_params(model, name))
            vtoken.unpatch(model)


def test_inputs_methods_cannot_take_are_not_offered():
    offered = app.offered("tiny-onevision")
    assert "fourier" in offered["image"] and offered["image"]["fourier"] is not None  # anyres images: no
    assert offered["video"]["fourier"] is None  # videos, frame by frame: yes
    assert "cls_attention" in offered["image"]["fastervlm"]  # SigLIP has no [CLS]


def test_mustdrop_on_llava_next_takes_its_official_layout():
    model, _ = app.get_model("tiny-llava-next")
    params = {"mustdrop": controls.default_params(model, "mustdrop")}
    (config,) = app.configurations(model, ["mustdrop"], [], "native", params)
    assert config.layout == "official" and "layout=official" in config.label


def test_stages_compose_and_llm_drops_map_onto_the_crops():
    values = control_values("tiny-llava-next")
    result = app.run_comparison("tiny-llava-next", "image", example_image(200), None, 2, "what?", ["hired"],
                                ["fastv"], "native", 1, 2, values)  # fmt: skip
    label, picture = result["rows"][1][0], result["pictures"][1]
    assert label.startswith("hired(") and "+ fastv(" in label
    assert "surviving the LLM's drops" in picture[1] and "base view + 1x2 crops" in picture[1]


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-onevision", "tiny-video-llava"])
def test_llm_order_matches_the_adapters_packing(name):
    """Independent check of the mapping FastV's records are drawn through: the adapter's own packed features
    hold a newline (or a [CLS]) exactly where `llm_order` puts an empty entry, and nothing else."""
    model, processor = app.get_model(name)
    video = name == "tiny-video-llava"
    inputs = runs.prepare_inputs(model, processor, "what?", *((None, _clip()) if video else (example_image(200), None)))
    records, adapter = views.probe_records(model, inputs)
    order = views.llm_order(views._crops(records, None, []), adapter, inputs)
    with vtoken.patched(model, vtoken.Random(budget=1.0)) as handle:
        kwargs = handle.adapter.calls.prepare(dict(inputs))[0]
    modality = "video" if video else "image"
    packed = kwargs["mm_encoder_outputs"][modality].pooler_output[0]
    assert len(order) == len(packed)
    if video:  # Video-LLaVA: each frame's [CLS] first
        assert [i for i, t in enumerate(order) if not t] == [i * 257 for i in range(len(records))]
    else:
        newline = adapter.inner.image_newline.to(packed)
        is_newline = torch.isclose(packed, newline).all(-1)
        assert is_newline.tolist() == [not t for t in order]
    with torch.inference_mode(), vtoken.patched(model, vtoken.FastV(layer=0, keep=0.5)) as handle:
        model.generate(**inputs, max_new_tokens=1)
        alive = views.survivors(order, handle.records)
    assert alive is not None and len(alive) > 0


def _clip():
    from vtoken.images import example_clip

    return example_clip(2, 112)


def test_errors_are_readable_and_raised_before_any_generation(monkeypatch):
    values = control_values("tiny-llava")
    calls = []
    monkeypatch.setattr(runs, "compare", lambda *a, **k: calls.append(1))  # where generation starts
    image = example_image(200)
    with pytest.raises(vtoken.InputError, match="question is empty"):
        app.run_comparison("tiny-llava", "image", image, None, 2, "  ", ["random"], [], "native", 1, 2, values)
    with pytest.raises(vtoken.InputError, match="no image"):
        app.run_comparison("tiny-llava", "image", None, None, 2, "what?", ["random"], [], "native", 1, 2, values)
    with pytest.raises(vtoken.InputError, match="no method ticked"):
        app.run_comparison("tiny-llava", "image", image, None, 2, "what?", [], [], "native", 1, 2, values)
    with pytest.raises(vtoken.InputError, match="no video"):
        app.run_comparison("tiny-llava", "video", image, None, 2, "what?", ["random"], [], "native", 1, 2, values)
    layer = [i for i, c in enumerate(controls.control_specs()) if (c.method, c.param) == ("fastv", "layer")][0]
    values[layer] = 5  # beyond the 2-layer LLM: FastV names the depth
    with pytest.raises(vtoken.VTokenError, match="fastv.*this LLM has 2 layers"):
        app.run_comparison("tiny-llava", "image", image, None, 2, "what?", ["random", "fastv"], [], "native", 1, 2,
                           values)  # fmt: skip
    with pytest.raises(vtoken.InputError, match="does not apply to tiny-llava"):
        app.run_comparison("tiny-llava", "image", image, None, 2, "what?", ["nosuch"], [], "native", 1, 2, values)
    assert calls == []  # nothing was generated


def test_an_mp4_upload_uses_all_its_sampled_frames(tmp_path):
    import av  # PyAV, in the demo extra: MP4 uploads

    from vtoken.images import example_clip

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        for frame in example_clip(6, 64):
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    values = control_values("tiny-video-llava")
    result = app.run_comparison("tiny-video-llava", "video", None, str(path), 3, "what moves?", ["random"], [],
                                "native", 1, 2, values)  # fmt: skip
    assert "3 frames" in result["pictures"][1][1]
    assert result["rows"][0][4] == f"all {3 * 257} kept"  # 3 frames of [CLS] + 256 patches reach the LLM


def test_free_parameters_and_layers_parse_or_say_why():
    assert controls.parse_free("x", "budget=0.5, scope='image'") == {"budget": 0.5, "scope": "image"}
    with pytest.raises(vtoken.InputError, match="not key=value"):
        controls.parse_free("x", "budget")
    control = controls.Control("mustdrop", "layers", "layers")
    assert controls.control_value(control, "0, 2") == (True, (0, 2))
    with pytest.raises(vtoken.InputError, match="mustdrop layers"):
        controls.control_value(control, "two")
    ratios = controls.Control("pyramiddrop", "ratios", "fractions")
    assert controls.control_value(ratios, "0.5, 0.25") == (True, (0.5, 0.25))
    with pytest.raises(vtoken.InputError, match="pyramiddrop ratios 'half': expected fractions"):
        controls.control_value(ratios, "half")
    counts = controls.Control("sparsevlm", "keep", "counts")
    assert controls.control_value(counts, "300 200") == (True, (300, 200))
    with pytest.raises(vtoken.InputError, match="give at least one"):
        controls.control_value(counts, " ")


def test_examples_where_pruning_changes_the_answer_do():
    model, processor = app.get_model(MINI)
    for index, kind, method, budget in app.CHANGED_ANSWERS:
        item = app.load_example(f"vtoken-mini: pruning changes the answer (test scene {index}, {kind}, {method} "
                                f"at {budget:.0%})")  # fmt: skip
        assert item["methods"] == (method, budget)
        inputs = runs.prepare_inputs(model, processor, item["question"], item["image"])
        answers = []
        for patch in (None, method):
            with torch.inference_mode(), vtoken.patched(model, patch, budget=budget) if patch else _nothing():
                out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
            answers.append(processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0])
        assert answers[0].split()[0] == item["expected"] and answers[1].split()[0] != item["expected"], answers
    assert all(app.load_example(e)["image"] or app.load_example(e)["video"] for e in app.examples_for(MINI))


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


def test_budget_sweep_matches_evaluate_run_by_hand():
    from vtoken.mini import vqa
    from vtoken.mini.evaluate import evaluate

    model, processor = app.get_model(MINI)
    seen = []
    base, points = runs.sweep(model, processor, ["random", "fastv"], [0.1], 5, lambda f, t: seen.append(t))
    pairs = vqa.question_set("test", 5)
    right = evaluate(model, processor, pairs).correct
    assert base.value == sum(right) / 5 and base.n == 5
    assert base.se == pytest.approx(np.std(np.array(right, dtype=float), ddof=1) / np.sqrt(5))
    with vtoken.patched(model, "fastv", keep=0.1):
        assert points[1].accuracy == points[1].estimate.value == evaluate(model, processor, pairs).accuracy()["all"]
    assert [p.method for p in points] == ["random", "fastv"] and points[0].tokens == 14
    assert seen[0] == "unpruned" and seen[-1] == "done"
    for name in ("mustdrop", "sparse_prefill"):
        with pytest.raises(vtoken.InputError, match="no token budget"):
            runs.sweep(model, processor, [name], [0.1], 5)


def test_the_sweep_offers_only_what_it_can_sweep():
    offered = app.offered_names(MINI, "image")
    sweepable = [m for m in offered if runs.sweep_knob(m) is not None]
    assert "sparse_prefill" not in sweepable and "mustdrop" not in sweepable
    assert {"fastervlm", "fastv", "random", "pool"} <= set(sweepable)


def test_vtoken_demo_command_line():
    from vtoken.cli import build_parser

    args = build_parser().parse_args(["demo", "--model", "tiny-llava", "--host", "0.0.0.0", "--port", "7999"])
    assert (args.model, args.host, args.port, args.share) == ("tiny-llava", "0.0.0.0", 7999, False)
    assert args.func.__name__ == "demo"


def test_the_comparison_times_every_setting_under_the_timing_rule(monkeypatch):
    """TTFT of the unpatched model and every configuration in one interleaved measurement (fresh patches around each
    run), shown as median and min-max; a speedup whose spread crosses 1.0 reads 'within noise' (synthetic
    timings in place of the measured ones)."""
    from vtoken.timing import Timing

    seen = {}

    def fake(model, inputs, settings, repeats):
        seen.update(names=list(settings), repeats=repeats)
        for make in settings.values():  # each context patches (or not) and leaves the model unpatched
            with make():
                pass
            assert vtoken.handle_of(model) is None
        times = [(0.020, 0.021, 0.022), (0.010, 0.0105, 0.011), (0.019, 0.021, 0.024)]
        return {name: Timing(t) for name, t in zip(settings, times, strict=True)}

    monkeypatch.setattr(runs, "time_to_first_token", fake)
    values = control_values(MINI)
    result = app.run_comparison(MINI, "image", example_image(200), None, 2, "what is it?", ["fastervlm", "random"], [],
                                "native", 3, 1, values)  # fmt: skip
    assert seen == {"names": ["unpatched", 1, 2], "repeats": 3}
    rows = result["rows"]
    assert rows[0][2] == "21.0 ms (20.0-22.0, n=3)" and rows[0][3] == "(baseline)"
    assert rows[1][3] == "2.00x faster (1.82-2.20)"
    assert "within noise" in rows[2][3] and "faster" not in rows[2][3]


def test_budget_controls_take_a_fraction_or_a_count_and_never_clamp():
    """'25' in a budget box is 25 tokens (not clamped to 1.0), '0.25' a quarter; the row says which; a value the
    library refuses is an error naming the control; every method with a budget starts at the same one."""
    from vtoken.budget import DEFAULT_BUDGET

    specs = controls.control_specs()
    budget_controls = [c for c in specs if c.param in ("budget", "keep") and c.kind not in controls.LISTS]
    assert budget_controls and all(c.kind == "budget" for c in budget_controls)  # not SparseVLM's per-layer counts
    model, _ = app.get_model(MINI)
    starts = {c.method: controls.default_params(model, c.method)["budget"] for c in specs if c.param == "budget"}
    assert starts.pop("tome") is None  # ToMe merges by its own r unless a budget is given
    assert set(starts.values()) == {DEFAULT_BUDGET}, starts

    fastervlm = next(c for c in specs if (c.method, c.param) == ("fastervlm", "budget"))
    assert controls.control_value(fastervlm, "25") == (True, 25)
    assert controls.control_value(fastervlm, "0.25") == (True, 0.25)
    assert controls.control_value(fastervlm, "") == (False, None)  # left empty: the method's own default
    for bad in ("1.5", "0", "abc"):
        with pytest.raises(vtoken.InputError, match="fastervlm budget"):
            controls.control_value(fastervlm, bad)

    values = control_values(MINI)
    values[specs.index(fastervlm)] = "25"
    result = app.run_comparison(MINI, "image", example_image(200), None, 2, "what is it?", ["fastervlm"], [],
                                "native", 1, 1, values)  # fmt: skip
    label, tokens = result["rows"][1][0], result["rows"][1][4]
    assert label == "fastervlm(budget=25 tokens)" and tokens == "144 -> 25 (17.4% kept)"
