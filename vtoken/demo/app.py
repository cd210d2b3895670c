"""The Gradio page: pick a model, an image or a video and a question, tick methods (each with its own controls),
and compare them side by side with the unpatched model; a second tab sweeps budgets on vtoken-mini.

    vtoken demo [--model vtoken-mini] [--host 127.0.0.1] [--port 7860] [--share]

Every event handler is a plain function of plain values (tested without a browser); `build_demo` wires them up.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

from PIL import Image

from .. import timing
from ..applicability import applicable_layouts, fitting_params
from ..errors import InputError, VTokenError
from ..images import example_clip, example_image, load_video
from ..modelview import model_view
from ..records import summarize
from ..registry import available_methods, method_class
from ..zoo import BUILTIN_MODELS, MINI, TINY_MODELS, load
from . import runs, views
from .charts import sweep_figure, tokens_figure
from .controls import control_specs, control_update, default_params, make_control, method_params
from .tables import CSS as TABLE_CSS
from .tables import html_table

DEFAULT_QUESTION = "What is in the image?"
DEFAULT_METHODS = ("fastervlm", "hired", "mmtok", "random")  # the first one offered is ticked at start
RANDOM_WEIGHTS_NOTE = (
    "**Note:** the `tiny-*` models have random weights: their answers are noise by design (they exercise every "
    "code path offline). `vtoken-mini` is trained on generated scenes: its answers are checkable."
)
# vtoken-mini test scenes where pruning changes the answer (found by running the model; the tests re-check them):
# (scene index, question type, method, budget)
CHANGED_ANSWERS = ((0, "colour", "random", 0.1), (26, "shape", "random", 0.1), (44, "read", "random", 0.1))

CSS = (
    """
#vtoken-error { border: 2px solid #d33; background: #fff0f0; padding: 8px 12px; border-radius: 6px; }
#vtoken-sweep-error { border: 2px solid #d33; background: #fff0f0; padding: 8px 12px; border-radius: 6px; }
/* the kept-token gallery grows with its pictures (no fixed height, no cut second row); captions wrap */
#vtoken-kept .grid-wrap { height: auto !important; max-height: none !important; overflow: visible !important; }
#vtoken-kept .caption-label { white-space: normal; max-width: calc(100% - 8px); }
@media (max-width: 640px) {
  #vtoken-kept .grid-container { grid-template-columns: minmax(0, 1fr) !important; }
}
"""
    + TABLE_CSS
)
_LOCK = threading.Lock()  # one model call at a time: patching is in place
_MODELS: dict[str, tuple] = {}
_OFFERED: dict[str, dict] = {}


# ----------------------------------------------------------------- models and the methods they offer


def get_model(name: str) -> tuple:
    """(model, processor), loaded once per name."""
    name = (name or "").strip()
    if not name:
        raise InputError("no model given; pick a built-in model or type a local checkpoint directory")
    if name not in BUILTIN_MODELS and not Path(name).is_dir():
        raise InputError(f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a local "
                         "checkpoint directory")  # fmt: skip
    if name not in _MODELS:
        _MODELS[name] = load(name)
    return _MODELS[name]


def offered(name: str) -> dict[str, dict[str, str | None]]:
    """Input kind -> method -> None (offered) or why not, for model `name` (computed once)."""
    if name not in _OFFERED:
        model, processor = get_model(name)
        with _LOCK:
            _OFFERED[name] = runs.offered_methods(model, processor)
    return _OFFERED[name]


def offered_names(name: str, kind: str) -> list[str]:
    return [m for m, reason in offered(name).get(kind, {}).items() if reason is None]


def model_note(name: str) -> str:
    model, _ = get_model(name)
    view = model_view(model)
    table = offered(name)
    kinds = " and ".join(table)
    lines = [f"**{name}**: `{type(model).__name__}` ({view.family}), an LLM of {view.llm_layers} layers; "
             f"takes {kinds}s."]  # fmt: skip
    for kind, verdicts in table.items():
        missing = {m: r for m, r in verdicts.items() if r is not None}
        if missing:
            lines.append(f"Not offered for {kind}s: " + "; ".join(f"`{m}` ({_first_clause(r)})"
                                                              for m, r in missing.items()))  # fmt: skip
    if name in TINY_MODELS:
        lines.append(RANDOM_WEIGHTS_NOTE)
    return "\n\n".join(lines)


def _first_clause(reason: str) -> str:
    """The gist of a refusal: "method 'x' needs the signal(s) [...]" without what the model provides."""
    return reason.split("; ")[0].split(", which")[0].removeprefix(f"method {reason.split()[1]} ").strip()


def configurations(model, methods: list[str], compose: list[str], layout: str, params: dict) -> list[runs.Config]:
    """One configuration per ticked method; encoder-only and tower-only methods get the composed LLM-stage methods
    after them.
    The layout is the one asked for where every method of the configuration takes it, else one they all take
    (MustDrop on LLaVA-NeXT: "official"), named in the configuration's label. A parameter the controls leave unset
    takes the value that fits the model (`fitting_params`: e.g. PruneVid's layer, the deepest that fits), else
    its default."""
    if not methods:
        raise InputError("no method ticked; tick at least one under 'methods'")
    configs = []
    params = {n: {**fitting_params(model, n), **params.get(n, {})} for n in {*methods, *compose}}
    for name in methods:
        stages = method_class(name).stages
        before_llm = tuple(stages) in (("encoder",), ("tower",))
        names = [name] + ([c for c in compose if c != name] if before_llm else [])
        fitting = None
        for n in names:
            layouts = applicable_layouts(model, n, **params.get(n, {}))
            fitting = layouts if fitting is None else [x for x in fitting if x in layouts]
        chosen = layout if layout in (fitting or []) else (fitting[0] if fitting else layout)
        configs.append(runs.Config(names, {n: params.get(n, {}) for n in names}, chosen))
    return configs


# ----------------------------------------------------------------- examples


def examples_for(name: str) -> list[str]:
    """The example menu of model `name`."""
    items = ["generated scene (shapes on a gradient)"]
    if name == MINI:
        from ..mini import vqa

        items.append("vtoken-mini: the default test scene")
        items += [f"vtoken-mini: pruning changes the answer (test scene {i}, {kind}, {method} at {budget:.0%})"
                  for i, kind, method, budget in CHANGED_ANSWERS]  # fmt: skip
        items += [f"vtoken-mini: test scene {i}, {kind} question" for i, kind in enumerate(vqa.QUESTION_TYPES, 10)]
    if "video" in offered(name):
        items.append("generated clip (8 frames panning over the scene)")
    return items


def load_example(choice: str) -> dict[str, Any]:
    """image / video path / question / expected answer (None if unknown) / methods and budget to set, of an
    example menu entry."""
    from ..mini import example, vqa

    out: dict[str, Any] = {"image": None, "video": None, "kind": "image", "expected": None, "methods": None}
    if choice.startswith("generated clip"):
        path = Path(tempfile.gettempdir()) / "vtoken_example_clip.gif"
        frames = example_clip(8, 224)
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=120, loop=0)
        return {**out, "video": str(path), "kind": "video", "question": "What moves in the video?"}
    if choice == "vtoken-mini: the default test scene":
        image, question, answer = example()
        return {**out, "image": image, "question": question, "expected": answer}
    if choice.startswith("vtoken-mini: pruning changes"):
        index = int(choice.split("test scene ")[1].split(",")[0])
        _, kind, method, budget = next(c for c in CHANGED_ANSWERS if c[0] == index)
        image, questions = vqa.sample("test", index)
        q = questions[vqa.QUESTION_TYPES.index(kind)]
        return {**out, "image": image, "question": q.text, "expected": q.answer, "methods": (method, budget)}
    if choice.startswith("vtoken-mini: test scene"):
        index = int(choice.split("test scene ")[1].split(",")[0])
        kind = choice.split(", ")[1].removesuffix(" question")
        image, questions = vqa.sample("test", index)
        q = questions[vqa.QUESTION_TYPES.index(kind)]
        return {**out, "image": image, "question": q.text, "expected": q.answer}
    return {**out, "image": example_image(), "question": DEFAULT_QUESTION}


# ----------------------------------------------------------------- the comparison


def run_comparison(
    model_name: str,
    kind: str,
    image: Image.Image | None,
    video_path: str | None,
    frames: int,
    question: str,
    methods: list[str],
    compose: list[str],
    layout: str,
    repeats: int,
    max_new_tokens: int,
    control_values: list[Any],
    expected: tuple[str, str] | None = None,
    progress=None,
) -> dict[str, Any]:
    """Everything the Compare tab shows: rows (configuration, answer, TTFT, speedup, tokens), pictures, chart
    data and records. Raises VTokenError (InputError for bad input) before anything is generated."""
    model, processor = get_model(model_name)
    specs = control_specs()
    params = method_params(specs, control_values)
    clip = None
    if kind == "video":
        if not video_path:
            raise InputError("no video given; upload an MP4 or GIF, or pick the generated clip example")
        clip = load_video(video_path, int(frames))
        image = None
    elif image is None:
        raise InputError("no image given; upload one, or pick an example")
    allowed = offered_names(model_name, kind)
    for name in [*methods, *compose]:
        if name not in allowed:
            reason = offered(model_name).get(kind, {}).get(name) or "not registered"
            raise InputError(f"{name} does not apply to {model_name} on {kind}s: {reason}")
    with _LOCK:
        inputs = runs.prepare_inputs(model, processor, question, image=image, frames=clip)
        configs = configurations(model, list(methods), list(compose), layout, params)
        runs.check_configs(model, configs, inputs)  # every error before any generation
        outcomes = runs.compare(model, processor, inputs, configs, int(repeats), int(max_new_tokens), progress)
        probes = {}
        pictures = []
        for outcome in outcomes:
            layout_of = outcome.adapter.layout if outcome.adapter is not None else "native"
            if (outcome.adapter is None or outcome.adapter.encoder_method is None) and layout_of not in probes:
                probes[layout_of] = views.probe_records(model, inputs, layout_of)
            picture, note = views.picture(outcome, model, processor, inputs, image, clip, probes.get(layout_of))
            pictures.append((picture, f"{outcome.label}: {note}" if note else outcome.label))
    base = outcomes[0].ttft
    check = expected is not None and expected[0] == question
    rows = []
    for o in outcomes:
        ratio = "(baseline)" if o is outcomes[0] else str(timing.compare(base, o.ttft))
        row = [o.label, o.answer, o.ttft.ms(), ratio, o.tokens.text()]
        if check:
            row.append("yes" if (o.answer.split() or [""])[0] == expected[1] else "no")
        rows.append(row)
    chart = [(o.label, stage, n) for o in outcomes for stage, n in runs.stage_tokens(o)]
    text = "\n\n".join(f"{o.label}\n{summarize(o.records)}" for o in outcomes[1:])
    counts = [o.tokens for o in outcomes]
    return {"rows": rows, "pictures": pictures, "chart": chart, "records": text, "expected": check, "counts": counts}


SWEEP_HEADERS = ["method", "budget", "visual tokens kept", "accuracy ± standard error [95 % interval] n"]
HEADERS = [
    "configuration",
    "answer",
    "time to first token (median, min-max)",
    "speedup vs unpatched",
    "visual tokens (the LLM's input)",
]


# ----------------------------------------------------------------- the page


def build_demo(start_model: str = MINI):
    import gradio as gr

    specs = control_specs()
    choices = list(BUILTIN_MODELS) + ([start_model] if start_model not in BUILTIN_MODELS else [])
    start = model_state(start_model)

    with gr.Blocks(title="vtoken demo") as demo:
        gr.Markdown(
            "# vtoken: visual-token pruning and merging, side by side\n"
            "Tick methods (each has its own settings below), run, and compare answers, time to first token and "
            "what each kept with the unpatched model. Dimmed patches were dropped; tinted ones were merged."
        )
        expected_state = gr.State(start["expected_state"])
        with gr.Tab("Compare"):
            with gr.Row():
                with gr.Column(scale=2):
                    with gr.Row():
                        model = gr.Dropdown(choices, value=start_model, label="model", scale=2)
                        checkpoint = gr.Textbox(label="or a local checkpoint directory", scale=2)
                        load_button = gr.Button("Load checkpoint", scale=1)
                    note = gr.Markdown(start["note"])
                    example = gr.Dropdown(start["examples"], value=None, label="example")
                    kind = gr.Radio(start["kinds"], value="image", label="input")
                    image = gr.Image(value=start["image"], type="pil", label="image", height=300)
                    video = gr.File(label="video (MP4 or GIF)", file_types=[".mp4", ".gif", ".webm", ".mov", ".avi"],
                                    type="filepath", visible=False)  # fmt: skip
                    frames = gr.Slider(2, 16, value=8, step=1, label="frames sampled from the video", visible=False)
                    question = gr.Textbox(value=start["question"], label="question")
                    expected = gr.Markdown(start["expected_text"])
                with gr.Column(scale=3):
                    methods = gr.CheckboxGroup(
                        start["methods"], value=start["ticked"], label="methods", elem_id="vtoken-methods"
                    )
                    compose = gr.CheckboxGroup(start["composable"], value=[],
                                               label="compose: add to every encoder method (LLM stages)")  # fmt: skip
                    layout = gr.Radio(start["layouts"], value="native", label="layout (anyres)",
                                      visible=len(start["layouts"]) > 1)  # fmt: skip
                    groups, components = {}, []
                    for name in available_methods():
                        with gr.Accordion(f"{name} settings", open=True, visible=name in start["ticked"]) as group:
                            with gr.Row():
                                for control in (c for c in specs if c.method == name):
                                    components.append(make_control(gr, control, start["defaults"].get(name, {})))
                        groups[name] = group
                    with gr.Row():
                        repeats = gr.Slider(
                            1,
                            20,
                            value=timing.DEFAULT_REPEATS,
                            step=1,
                            label="timed runs per setting (interleaved, after a warm-up)",
                        )
                        max_new = gr.Slider(1, 64, value=16, step=1, label="max new tokens")
                    run_button = gr.Button("Run", variant="primary")
            error = gr.Markdown(visible=False, elem_id="vtoken-error")
            table = gr.HTML(label="results", elem_id="vtoken-results")
            gallery = gr.Gallery(label="what was kept (first image or video)", columns=3, object_fit="contain",
                                 height="auto", elem_id="vtoken-kept")  # fmt: skip
            chart = gr.Plot(label="visual tokens per stage")
            records = gr.Code(label="records", language=None, lines=8)

        with gr.Tab("Budget sweep (vtoken-mini)"):
            gr.Markdown(
                "Accuracy of vtoken-mini on its procedural test questions (the benchmark's question set, every "
                "question type in turn) against the visual tokens kept, for each method at each budget."
            )
            sweepable = [m for m in offered_names(MINI, "image") if runs.sweep_knob(m) is not None]
            sweep_methods = gr.CheckboxGroup(sweepable, value=[m for m in ("fastervlm", "random") if m in sweepable],
                                             elem_id="vtoken-sweep-methods",
                                             label="methods to sweep")  # fmt: skip
            budgets = gr.CheckboxGroup(["50%", "25%", "10%", "5%"], value=["50%", "25%", "10%", "5%"], label="budgets",
                                       elem_id="vtoken-budgets")  # fmt: skip
            questions = gr.Slider(10, 250, value=50, step=10, label="questions")
            sweep_button = gr.Button("Run sweep", variant="primary")
            sweep_error = gr.Markdown(visible=False, elem_id="vtoken-sweep-error")
            sweep_plot = gr.Plot(label="accuracy vs visual tokens kept")
            sweep_table = gr.HTML(label="sweep", elem_id="vtoken-sweep")

        # ------------------------------------------------------------- events
        outputs = [error, table, gallery, chart, records]

        def cleared(message: str | None = None) -> list:
            shown = gr.update(value=f"**Error:** {message}", visible=True) if message else gr.update(visible=False)
            return [shown, gr.update(value=""), gr.update(value=None), gr.update(value=None), gr.update(value="")]

        def on_run(*values, progress=gr.Progress()):  # noqa: B008 (how Gradio injects progress)
            (name, kind_, image_, video_, frames_, question_, methods_, compose_, layout_, repeats_, max_new_,
             expected_) = values[:12]  # fmt: skip
            try:
                result = run_comparison(name, kind_, image_, video_, frames_, question_, methods_, compose_, layout_,
                                        repeats_, max_new_, list(values[12:]), expected_,
                                        lambda f, text: progress(f, desc=text))  # fmt: skip
            except VTokenError as err:
                return cleared(str(err))
            except Exception as err:  # anything else still reaches the page, named
                return cleared(f"{type(err).__name__}: {err}")
            headers = HEADERS + (["matches expected"] if result["expected"] else [])
            return [
                gr.update(visible=False),
                gr.update(value=html_table(headers, result["rows"])),
                result["pictures"],
                tokens_figure(result["chart"]),
                result["records"],
            ]

        run_inputs = [model, kind, image, video, frames, question, methods, compose, layout, repeats, max_new,
                      expected_state, *components]  # fmt: skip
        run_button.click(on_run, run_inputs, outputs, concurrency_limit=1)

        def on_methods(ticked, composed):
            return [gr.update(visible=n in (ticked or []) or n in (composed or [])) for n in groups]

        methods.change(on_methods, [methods, compose], list(groups.values()))
        compose.change(on_methods, [methods, compose], list(groups.values()))

        def on_model(name):
            try:
                state = model_state(name)
            except (VTokenError, OSError, ValueError) as err:
                return [gr.update()] * (len(model_outputs) - 5) + cleared(f"cannot load {name!r}: {err}")
            updates = [
                gr.update(value=state["note"]),
                gr.update(choices=state["examples"], value=None),
                gr.update(choices=state["kinds"], value="image"),
                gr.update(value=state["image"], visible=True),
                gr.update(value=None, visible=False),
                gr.update(visible=False),
                gr.update(value=state["question"]),
                gr.update(value=state["expected_text"]),
                state["expected_state"],
                gr.update(choices=state["methods"], value=state["ticked"]),
                gr.update(choices=state["composable"], value=[]),
                gr.update(choices=state["layouts"], value="native", visible=len(state["layouts"]) > 1),
            ]
            updates += [gr.update(visible=n in state["ticked"]) for n in groups]
            updates += [control_update(gr, c, state["defaults"].get(c.method, {})) for c in specs]
            return updates + cleared()

        model_outputs = [note, example, kind, image, video, frames, question, expected, expected_state, methods,
                         compose, layout, *groups.values(), *components, *outputs]  # fmt: skip
        model.change(on_model, [model], model_outputs)

        def on_checkpoint(path):
            return gr.update(choices=choices + [path], value=path) if path and path.strip() else gr.update()

        load_button.click(on_checkpoint, [checkpoint], [model])

        def on_kind(kind_, name):
            allowed = offered_names(name, kind_)
            return [
                gr.update(visible=kind_ == "image"),
                gr.update(visible=kind_ == "video"),
                gr.update(visible=kind_ == "video"),
                gr.update(choices=allowed, value=[m for m in allowed if m in DEFAULT_METHODS][:1] or allowed[:1]),
            ]

        kind.change(on_kind, [kind, model], [image, video, frames, methods])

        def on_example(choice):
            if not choice:
                return [gr.update()] * (7 + len(specs))
            item = load_example(choice)
            picked, budgets_ = gr.update(), {}
            if item["methods"]:  # a case where pruning changes the answer: FasterVLM and the method, same budget
                method, budget = item["methods"]
                picked = gr.update(value=["fastervlm", method])
                budgets_ = {("fastervlm", "budget"): budget, (method, "budget"): budget}
            video_kind = item["kind"] == "video"
            text = f"Expected answer (from the scene's drawing): **{item['expected']}**" if item["expected"] else ""
            return [
                gr.update(value=item["kind"]),
                gr.update(value=item["image"], visible=not video_kind) if item["image"] else gr.update(),
                gr.update(value=item["video"], visible=video_kind) if item["video"] else gr.update(),
                gr.update(value=item["question"]),
                gr.update(value=text),
                (item["question"], item["expected"]) if item["expected"] else None,
                picked,
                *[
                    gr.update(value=str(budgets_[c.method, c.param]))
                    if (c.method, c.param) in budgets_
                    else gr.update()
                    for c in specs
                ],
            ]

        example.change(on_example, [example],
                       [kind, image, video, question, expected, expected_state, methods, *components])  # fmt: skip

        def on_sweep(methods_, budgets_, questions_, progress=gr.Progress()):  # noqa: B008 (how Gradio injects progress)
            try:
                model_, processor = get_model(MINI)
                with _LOCK:
                    base, points = runs.sweep(model_, processor, list(methods_),
                                              [float(b.rstrip("%")) / 100 for b in budgets_], int(questions_),
                                              lambda f, text: progress(f, desc=text))  # fmt: skip
            except VTokenError as err:
                return [gr.update(value=f"**Error:** {err}", visible=True), None, ""]
            rows = [["unpruned", "100%", 144, base.text()]]
            rows += [[p.method, f"{p.budget:.0%}", round(p.tokens, 1), p.estimate.text()] for p in points]
            return [gr.update(visible=False), sweep_figure(base, points), html_table(SWEEP_HEADERS, rows)]

        sweep_button.click(on_sweep, [sweep_methods, budgets, questions], [sweep_error, sweep_plot, sweep_table],
                           concurrency_limit=1)  # fmt: skip
    return demo


def model_state(name: str) -> dict[str, Any]:
    """What the page shows when model `name` is picked."""
    model, _ = get_model(name)
    names = offered_names(name, "image")
    view = model_view(model)
    if name == MINI:
        from ..mini import example

        image, question, answer = example()
    else:
        image, question, answer = example_image(), DEFAULT_QUESTION, None
    ticked = [m for m in DEFAULT_METHODS if m in names][:1] or names[:1]
    return {
        "note": model_note(name),
        "examples": examples_for(name),
        "kinds": list(offered(name)),
        "image": image,
        "question": question,
        "expected_text": f"Expected answer (from the scene's drawing): **{answer}**" if answer else "",
        "expected_state": (question, answer) if answer else None,
        "methods": names,
        "ticked": ticked,
        "composable": [m for m in names if not {"tower", "encoder"} & set(method_class(m).stages)],
        "layouts": list(view.layouts),
        "defaults": {m: default_params(model, m) for m in available_methods()},
    }


def main(argv: list[str] | None = None) -> None:
    """`python demo/app.py [options]`: the same as `vtoken demo [options]`."""
    import argparse
    import sys

    from .arguments import demo_arguments

    parser = argparse.ArgumentParser(prog="python -m vtoken.demo", description="the vtoken Gradio demo")
    demo_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch(args.model, args.host, args.port, args.share)
    except VTokenError as err:
        sys.exit(f"vtoken demo: error: {err}")


def launch(model: str = MINI, host: str = "127.0.0.1", port: int = 7860, share: bool = False, **kwargs):
    """Build the page on `model` and serve it (blocks unless `prevent_thread_lock=True` is passed)."""
    try:
        import gradio  # noqa: F401
    except ImportError as err:
        raise VTokenError("the demo needs gradio: pip install 'vtoken[demo]'") from err
    return build_demo(model).launch(server_name=host, server_port=port, share=share, css=CSS, **kwargs)
