"""What the demo computes, without any UI: inputs, configurations checked before anything runs, answers, time to
first token, records, and the budget sweep on vtoken-mini."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from .. import api
from ..applicability import applicable_layouts, applicable_methods, fitting_params
from ..counts import VisualCounts, count, llm_input, placeholders
from ..errors import InputError, VTokenError
from ..images import example_clip, example_image
from ..methods.base import Method
from ..modelview import model_view
from ..prompts import build_prompt
from ..records import Record, llm_point_label
from ..registry import describe_method, make_method, method_class
from ..specs import common_budget
from ..stats import Estimate, mean_estimate
from ..timing import DEFAULT_REPEATS, Timing, time_to_first_token

Progress = Callable[[float, str], None]


def video_capable(model) -> bool:
    """Whether the model's adapter takes videos."""
    return "video" in model_view(model).modalities


def prepare_inputs(model, processor, question: str, image: Image.Image | None = None, frames: list | None = None):
    """The processor's batch for one question about one image or one video (a list of frames), pixels in the
    model's dtype. Refuses empty input with an `InputError` saying what is missing."""
    if not question or not question.strip():
        raise InputError("the question is empty; type a question about the image or video")
    if image is None and not frames:
        raise InputError("no image or video given; upload one, or pick an example")
    if frames:
        if not video_capable(model):
            raise InputError(f"{type(model).__name__} takes no videos; upload an image, or pick a video model")
        prompt = build_prompt(processor, question.strip(), num_images=0, num_videos=1)
        inputs = processor(text=[prompt], videos=[frames], return_tensors="pt")
    else:
        prompt = build_prompt(processor, question.strip())
        inputs = processor(text=[prompt], images=[image.convert("RGB")], return_tensors="pt")
    inputs = inputs.to(model.device)
    for key, value in inputs.items():
        if value.is_floating_point():
            inputs[key] = value.to(model.dtype)
    return inputs


@dataclass
class Config:
    """One configuration: methods (one per stage) with their parameters, and the anyres layout."""

    methods: list[str]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    layout: str = "native"

    @property
    def label(self) -> str:
        """What the row applies: each method with its budget (a % or a token count), layer and changed knobs."""
        parts = [describe_method(m) for m in self.build()]
        return " + ".join(parts) + (f" [layout={self.layout}]" if self.layout != "native" else "")

    def build(self) -> list[Method]:
        return [make_method(name, **self.params.get(name, {})) for name in self.methods]


@dataclass
class Outcome:
    """One column of the comparison."""

    label: str
    answer: str
    ttft: Timing | None  # time to first token (None until timed)
    records: list[Record]
    tokens: VisualCounts  # visual tokens of the LLM's input, unpatched and here, and after each prefill stage
    adapter: Any = None  # the patch's adapter (layout helpers for the pictures); None unpatched
    merges: list = field(default_factory=list)  # MustDrop's merge plans, one per encoder batch


def check_configs(model, configs: list[Config], inputs) -> None:
    """Patch with every configuration and run its encoder stage on `inputs`: a method that cannot apply, or an
    input a method cannot take, raises here, before any generation (message prefixed by the configuration)."""
    for config in configs:
        try:
            with torch.no_grad(), api.patched(model, config.build(), layout=config.layout) as handle:
                if handle.adapter.encoder_method is not None and handle.adapter.present(inputs):
                    handle.adapter.calls.prepare(dict(inputs))
        except VTokenError as err:
            raise type(err)(f"{config.label}: {err}") from err


def _answer(model, processor, inputs, max_new_tokens: int) -> str:
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()


def _recording_merges(methods: list[Method]) -> list:
    """Record the merge plans of a method that merges inside the tower (MustDrop), for the pictures."""
    plans: list = []
    for method in methods:
        planner = getattr(method, "plan_merge", None)
        if planner is not None:

            def record(*args, _planner=planner, **kwargs):
                plan = _planner(*args, **kwargs)
                plans.append(plan)
                return plan

            object.__setattr__(method, "plan_merge", record)  # this instance only
    return plans


@torch.inference_mode()
def compare(
    model,
    processor,
    inputs,
    configs: list[Config],
    repeats: int = DEFAULT_REPEATS,
    max_new_tokens: int = 16,
    progress: Progress | None = None,
) -> list[Outcome]:
    """The unpatched model, then every configuration: greedy answer and records; then time to first token of all
    of them under `vtoken.timing`'s rule (one-token `generate`, settings interleaved after a warm-up, median and
    min-max of `repeats`). Call `check_configs` first."""
    visual = placeholders(model, inputs["input_ids"])[0]
    steps = len(configs) + 2
    say = progress or (lambda fraction, text: None)
    say(0.0, "unpatched")
    unpatched = VisualCounts(visual, visual)
    outcomes = [Outcome("unpatched", _answer(model, processor, inputs, max_new_tokens), None, [], unpatched)]
    for i, config in enumerate(configs, 1):
        say(i / steps, config.label)
        methods = config.build()
        merges = _recording_merges(methods)
        with api.patched(model, methods, layout=config.layout) as handle, llm_input(model) as lengths:
            answer = _answer(model, processor, inputs, max_new_tokens)
            records = list(handle.records)
            kept_merges = list(merges)
            tokens = count(model, inputs, lengths, records)
            outcomes.append(Outcome(config.label, answer, None, records, tokens, handle.adapter, kept_merges))
    say((steps - 1) / steps, f"time to first token, {repeats} interleaved runs each")
    contexts = {"unpatched": nullcontext}
    for i, config in enumerate(configs, 1):  # a fresh patch around every timed run, outside the timer
        contexts[i] = lambda config=config: api.patched(model, config.build(), layout=config.layout)
    timed = time_to_first_token(model, inputs, contexts, repeats=repeats)
    for outcome, key in zip(outcomes, contexts, strict=True):
        outcome.ttft = timed[key]
    say(1.0, "done")
    return outcomes


def stage_tokens(outcome: Outcome) -> list[tuple[str, int]]:
    """(step, visual tokens) for a chart: the prompt's visual tokens, those of the LLM's input (when a stage
    shortened it) and those after each prefill stage; all under `vtoken.counts`' definition."""
    rows = [("input", outcome.tokens.unpatched)]
    if outcome.tokens.llm_input != outcome.tokens.unpatched:
        rows.append(("LLM input", outcome.tokens.llm_input))
    rows += [(llm_point_label(stage), n) for stage, n in outcome.tokens.inside]
    return rows


# ----------------------------------------------------------------- which methods the demo offers


def offered_methods(model, processor) -> dict[str, dict[str, str | None]]:
    """Per input kind ("image", and "video" on video models): method -> None if it applies to that input on this
    model, else why not. Model-level checks are `applicable_methods`; input-level ones (e.g. Fourier-VLM on anyres
    images) run the method's encoder stage on a small example input."""
    verdicts = applicable_methods(model)
    kinds = {"image": dict(image=example_image(336))}
    if video_capable(model):
        kinds["video"] = dict(frames=example_clip(2, 112))
    offered = {}
    for kind, given in kinds.items():
        inputs = prepare_inputs(model, processor, "what is in the image?", **given)
        out = {}
        for name, reason in verdicts.items():
            if reason is None and kind not in method_class(name).modalities:  # e.g. an LLM stage for videos only
                reason = f"{name} acts on {' and '.join(method_class(name).modalities)} inputs only"
            if reason is None and {"tower", "encoder"} & set(method_class(name).stages):  # runs before the LLM
                params = fitting_params(model, name)
                layout = applicable_layouts(model, name, **params)[0]
                try:
                    check_configs(model, [Config([name], {name: params}, layout)], inputs)
                except VTokenError as err:
                    reason = str(err)
            out[name] = reason
        offered[kind] = out
    return offered


# ----------------------------------------------------------------- the budget sweep on vtoken-mini


@dataclass
class SweepPoint:
    """One method at one budget: mean visual tokens kept, accuracy, and the accuracy with n / standard error /
    95 % interval."""

    method: str
    budget: float
    tokens: float
    accuracy: float
    estimate: Estimate


def sweep_knob(method: str) -> str | None:
    """The parameter a budget sweep (fractions kept) sets on `method`: its declared `budget_param` (its `budget`,
    FastV's `keep`); None if it has none that takes a fraction (its knobs are thresholds, e.g. MustDrop; it keeps
    every token, e.g. sparse prefill; its budget is an official count, SparseVLM): the sweep does not offer it."""
    return common_budget(method_class(method), 0.5)


def sweep(
    model,
    processor,
    methods: list[str],
    budgets: list[float],
    questions: int = 50,
    progress: Progress | None = None,
) -> tuple[float, list[SweepPoint]]:
    """Accuracy on `questions` procedural test questions of vtoken-mini (the benchmark's question set) unpruned,
    and for every method at every budget (its `budget`, FastV's `keep`): (unpruned accuracy estimate, points)."""
    from ..mini import vqa
    from ..mini.evaluate import evaluate

    if not methods or not budgets:
        raise InputError("pick at least one method and one budget for the sweep")
    pairs = vqa.question_set("test", questions)
    say = progress or (lambda fraction, text: None)
    total = 1 + len(methods) * len(budgets)
    say(0.0, "unpruned")
    base = mean_estimate([float(c) for c in evaluate(model, processor, pairs).correct])
    points, step = [], 1
    for method in methods:
        knob = sweep_knob(method)
        if knob is None:
            raise InputError(f"{method} has no token budget (its knobs are thresholds, or it keeps every token); "
                             "sweep another method")  # fmt: skip
        for budget in budgets:
            say(step / total, f"{method} at {budget:.0%}")
            step += 1
            with api.patched(model, method, **{knob: budget}):
                result = evaluate(model, processor, pairs)
            estimate = mean_estimate([float(c) for c in result.correct])
            points.append(SweepPoint(method, budget, statistics.mean(result.tokens), estimate.value, estimate))
    say(1.0, "done")
    return base, points
