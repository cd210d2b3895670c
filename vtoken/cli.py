"""`vtoken` command line: run a model with and without token reduction on one image and compare."""

# Only light modules at the top (argparse, vtoken's budget/errors/specs/timing): `vtoken --help` must not import
# torch or transformers. Everything heavy is imported inside the command that needs it.
from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from .budget import DEFAULT_BUDGET, parse_number
from .errors import InputError, VTokenError
from .registry import LAYOUTS
from .specs import build_methods, common_budget, method_names, parse_param
from .timing import DEFAULT_REPEATS, summary, time_to_first_token

DEFAULT_MODEL = "vtoken-mini"  # vtoken.zoo.MINI (the zoo imports torch, so the name is repeated; a test checks it)

DEFAULT_PROMPT = "What is in the image?"
DTYPES = ("float32", "bfloat16", "float16")
TIMING_RULE = "median of {n} interleaved runs after a warm-up, min-max in brackets; ratio vs unpatched"


def parse_budget(text: str) -> float | int:
    """'0.25' -> 0.25 (fraction kept), '144' -> 144 (tokens per crop); checked with the method, before loading."""
    try:
        return parse_number(text)
    except VTokenError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _answer(model, processor, inputs, max_new_tokens: int) -> str:
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()


def method_params(spec: str, budget: float | int | None, params: list[str] = ()) -> dict[str, Any]:
    """`--method`, `--budget` and `--param` as `vtoken.specs` parameters ("name.param" -> value).

    `--budget` sets every listed method's declared budget parameter (`Method.budget_param`): its `budget`, FastV's
    and DART's `keep` (MustDrop's knobs are its thresholds, PyramidDrop's its ratios). Without it, every
    encoder-stage method starts at `DEFAULT_BUDGET` (as in the demo) and FastV and DART keep their own `keep`.
    SparseVLM's budget is one of its official average counts (`--budget 192`, 128, 96 or 64): a fraction leaves
    its default (192). `--param name.param=value` (or an unprefixed `param=value`) comes last and wins."""
    from .registry import method_class

    names = method_names(spec, "--method")
    given = dict(parse_param(p) for p in params)
    explicit = set()  # (method, parameter) pairs --param sets: --budget leaves those alone
    for key in given:
        prefix, dot, param = key.partition(".")
        cls = method_class(prefix) if dot else None
        explicit.update([(cls.name if cls else prefix, param)] if dot else [(n, key) for n in names])
    out: dict[str, Any] = {}
    for name in names:
        cls = method_class(name)
        knob = common_budget(cls, budget)
        # parameters that stand for the budget (VisionZip's dominant/contextual): given, the budget is not set
        instead = cls.budget_alternatives
        if knob is not None and (name, knob) not in explicit and not any((name, p) in explicit for p in instead):
            out[f"{name}.{knob}"] = DEFAULT_BUDGET if budget is None else budget
    return {**out, **given}


def build(args: argparse.Namespace) -> list:
    """Fresh method objects of `--method` with `--budget` and `--param` (errors name the flag)."""
    return build_methods(args.method, method_params(args.method, args.budget, args.param), [], source="--param")


def kept_map(record) -> str:
    """A text picture of one crop's token grid: '#' kept, '.' dropped (rows of the grid, raster order)."""
    rows, cols = record.grid
    kept = set(record.kept.tolist())
    return "\n".join("  " + "".join("#" if r * cols + c in kept else "." for c in range(cols)) for r in range(rows))


def _example(args: argparse.Namespace) -> tuple:
    """(image, question, expected answer or None) when no image/video is given: vtoken-mini's generated scene
    and its question, else the generic example scene."""
    if args.model == DEFAULT_MODEL:
        from .mini import example

        image, question, answer = example()
        return image, args.prompt or question, answer if args.prompt in (None, question) else None
    from .images import example_image

    return example_image(), args.prompt or DEFAULT_PROMPT, None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_device(name: str) -> None:
    """Raise unless `name` is a torch device this machine has (e.g. --device cuda without a GPU)."""
    import torch

    try:
        torch.empty(0, device=torch.device(name))
    except (RuntimeError, AssertionError) as err:  # unknown device string; no driver; torch built without it
        here = ["cpu"] + ["cuda"] * torch.cuda.is_available() + ["mps"] * torch.backends.mps.is_available()
        raise VTokenError(f"--device {name!r} is not available here ({_first_line(err)}); this machine has: "
                          f"{', '.join(here)}") from None  # fmt: skip


def check_run_args(args: argparse.Namespace) -> None:
    """Everything about `vtoken run`'s arguments that can be checked before the model loads (an unknown method, a
    bad budget or parameter fails here, not after loading)."""
    for flag, value in (("--frames", args.frames), ("--max-new-tokens", args.max_new_tokens),
                        ("--repeats", args.repeats)):  # fmt: skip
        if value < 1:
            raise VTokenError(f"{flag} {value}; expected an int >= 1")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise VTokenError(f"--dtype {args.dtype!r}; accepted: {', '.join(DTYPES)} (default: the checkpoint's)")
    if args.device is not None:
        check_device(args.device)
    if args.image and args.video:
        raise VTokenError("--image and --video were both given; pass one of them, not both")
    if args.prompt is not None and not args.prompt.strip():
        raise VTokenError("--prompt is empty; give a question, or leave --prompt out for the default one")
    for what, path in (("image", args.image), ("video", args.video)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"cannot read {what} {path!r}: no such file")
    if "/" in args.model and not Path(args.model).exists():  # a hub id: an unreachable hub fails now, in seconds
        from .hub import hub_kwargs

        hub_kwargs(args.model)
    build(args)


def load_model(args: argparse.Namespace) -> tuple:
    """(model, processor) of --model, with load failures (offline hub, bad checkpoint) as one-line errors."""
    from .modelview import model_view
    from .zoo import load

    try:
        model, processor = load(args.model, dtype=args.dtype, device=args.device)
    except VTokenError:
        raise
    except (OSError, ValueError) as err:
        raise VTokenError(f"cannot load model {args.model!r}: {_first_line(err)}") from err
    view = model_view(model)  # an unsupported model fails here, before any run
    if args.video and getattr(processor, "video_processor", None) is None:  # its processor takes no videos
        raise VTokenError(f"{args.model} ({view.family}) takes no videos; use --image")
    return model, processor


def _process(processor, args: argparse.Namespace, prompt: str, visual: dict) -> Any:
    """The processor's inputs; a video it refuses (too few frames for its temporal patch) as one line."""
    try:
        return processor(text=[prompt], return_tensors="pt", **visual)
    except ValueError as err:
        if not args.video:
            raise
        frames = len(visual["videos"][0])
        need = getattr(getattr(processor, "video_processor", None), "temporal_patch_size", None)
        if isinstance(need, int) and frames < need:
            raise VTokenError(
                f"--video {args.video!r} gave {frames} frame(s); {args.model}'s processor needs at least {need} "
                f"(its temporal patch): pass a video with more frames, with --frames {need} or more"
            ) from None
        raise VTokenError(f"{args.model}'s processor cannot take --video {args.video!r}: {_first_line(err)}") from None


def run(args: argparse.Namespace) -> int:
    check_run_args(args)
    import torch

    from . import api
    from .counts import count, llm_input
    from .images import load_image, load_video
    from .prompts import build_prompt
    from .registry import describe_method
    from .zoo import TINY_MODELS

    torch.manual_seed(0)
    model, processor = load_model(args)
    api.check(model, build(args), layout=args.layout)  # a method or layout the model refuses fails before any run
    expected = None
    if args.video:
        if getattr(processor, "video_processor", None) is None:  # its processor would drop the video silently
            raise VTokenError(f"model {args.model!r} ({type(model).__name__}) takes no video; pass --image")
        visual = {"videos": [load_video(args.video, args.frames)]}
        args.prompt = args.prompt or DEFAULT_PROMPT
        prompt = build_prompt(processor, args.prompt, num_images=0, num_videos=1)
    else:
        if args.image:
            image, args.prompt = load_image(args.image), args.prompt or DEFAULT_PROMPT
        else:
            image, args.prompt, expected = _example(args)
        visual = {"images": [image]}
        prompt = build_prompt(processor, args.prompt)
    inputs = _process(processor, args, prompt, visual).to(model.device)
    for key, value in inputs.items():  # pixels in the model's dtype
        if value.is_floating_point():
            inputs[key] = value.to(model.dtype)

    with torch.inference_mode():
        base_answer = _answer(model, processor, inputs, args.max_new_tokens)
        methods = build(args)
        with api.patched(model, methods, layout=args.layout) as handle, llm_input(model) as lengths:
            answer = _answer(model, processor, inputs, args.max_new_tokens)
            records = list(handle.records)
        timed = time_to_first_token(
            model, inputs,
            {"unpatched": nullcontext, "patched": lambda: api.patched(model, build(args), layout=args.layout)},
            repeats=args.repeats,
        )  # fmt: skip

    visual = count(model, inputs, lengths, records)
    print(f"model:   {args.model} ({type(model).__name__}, {model.dtype}, {model.device})")
    print(f"input:   {args.video or args.image or 'generated example scene'}")
    print(f"prompt:  {args.prompt!r}")
    layout = f" [layout={args.layout}]" if args.layout != "native" else ""
    print(f"method:  {' + '.join(describe_method(m) for m in methods)}{layout}")
    print(f"visual tokens (the LLM's input): {visual.text()}")
    print(f"time to first token ({TIMING_RULE.format(n=args.repeats)}):")
    print("\n".join("  " + line for line in summary(timed, base="unpatched")))
    print(f"answer (unpatched): {base_answer!r}")
    print(f"answer (patched):   {answer!r}")
    if expected is not None:
        print(f"expected answer:    {expected!r} (from the scene's drawing parameters)")
    # the last stage before the LLM that kept tokens on a grid: the encoder's, else a tower method's (PixelPrune)
    drawn = [r for r in records if r.stage == "encoder"] or [r for r in records if r.stage == "tower"]
    if len(drawn) == 1 and drawn[0].kept is not None and drawn[0].grid[0] > 1:
        print(f"kept tokens ({'x'.join(map(str, drawn[0].grid))} grid, '#' kept):\n{kept_map(drawn[0])}")
    if args.model in TINY_MODELS:
        print("note: built-in tiny models have random weights, so their answers are noise by design")
    return 0


def method_line(cls) -> str:
    """One method as `vtoken list` shows it, from its declaration: 'fastv (prefill): keep, layer, positions; --budget
    sets keep', 'pool (encoder, merges): budget, scope; --budget sets budget'."""
    what = ", ".join([*cls.stages, *["video only"] * (tuple(cls.modalities) == ("video",)), *["merges"] * cls.merges])
    line = f"{cls.name} ({what}): {', '.join(cls.declared_params()) or 'no parameters'}"
    return line + (f"; --budget sets {cls.budget_param}" if cls.budget_param else "")


def list_all(args: argparse.Namespace) -> int:
    from .registry import available_methods, method_class, supported_models
    from .zoo import BUILTIN_MODELS

    print("methods:", ", ".join(available_methods()))
    for name in available_methods():
        try:
            print("  " + method_line(method_class(name)))
        except VTokenError as err:  # an installed plugin that fails to load: the others are listed
            print(f"  {name}: {err}")
    for family, classes in supported_models().items():
        print(f"model family {family}: {', '.join(classes)}")
    print("built-in models:", ", ".join(BUILTIN_MODELS))
    return 0


def demo(args: argparse.Namespace) -> int:
    from .demo.app import launch

    launch(args.model, args.host, args.port, args.share)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtoken", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="answer a prompt about an image, unpatched and patched, and compare")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a built-in model (vtoken-mini, tiny-llava, ...: see `vtoken list`), a local checkpoint "
                        "directory or a hub id (owner/name)")  # fmt: skip
    p.add_argument(
        "--method",
        default="fastervlm",
        help="a method (see `vtoken list`), or several joined by '+' to compose stages (hired+fastv)",
    )
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a method parameter, as in `vtoken eval`: fastv.keep=0.5, mustdrop.layers=[2,6] "
                        "(repeatable; wins over --budget)")  # fmt: skip
    p.add_argument("--budget", type=parse_budget, default=None,
                   help=f"a fraction kept (0.25) or a token count (144, per crop or image as the method counts); "
                        f"default {DEFAULT_BUDGET} for every method with a budget, FastV's own keep")  # fmt: skip
    p.add_argument("--layout", default="native", choices=LAYOUTS,
                   help="how the kept tokens are packed: the model's own (native) or a seed method's (official: "
                        "LLaVA-NeXT's and OneVision's flat crops, which the tower methods take there)")  # fmt: skip
    p.add_argument("--image", default=None, help="image file (default: a generated example scene and its question)")
    p.add_argument("--video", default=None, help="video file (GIF; MP4 and others with PyAV) instead of an image")
    p.add_argument("--frames", type=int, default=8, help="frames sampled uniformly from --video")
    p.add_argument("--prompt", default=None, help=f"question (default: the example's own, else {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--repeats",
        "--runs",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed runs per setting, interleaved after a warm-up (median and min-max printed)",
    )
    p.add_argument("--dtype", default=None, help=f"{', '.join(DTYPES)} (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cpu)")
    p.set_defaults(func=run)
    sub.add_parser("list", help="methods, model families and built-in models").set_defaults(func=list_all)
    from .eval.sweep import add_parser as add_eval_parser  # lmms-eval is imported only when `vtoken eval` runs

    add_eval_parser(sub)
    p = sub.add_parser("demo", help="the Gradio demo in a browser (needs pip install 'vtoken[demo]')")
    from .demo import demo_arguments

    demo_arguments(p)
    p.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VTokenError as err:
        print(f"vtoken: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
