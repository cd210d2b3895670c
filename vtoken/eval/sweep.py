"""`vtoken eval`: a method x budget sweep through lmms-eval's own evaluator, one process, one model load.

    vtoken eval --model vtoken-mini --tasks vtoken_mini_vqa --methods fastervlm,random,pool \
        --budgets 0.5,0.25,0.1 --limit 200 --out results/

The unpatched model runs first (the retention baseline); then every method at every budget (a method without a
budget or keep parameter, e.g. MustDrop, runs once with its own parameters). Writes `sweep.json`, `sweep.md`,
`sweep.png` (accuracy vs kept visual tokens) and each setting's samples log, and prints the retention table.
"""

from __future__ import annotations

import argparse
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..budget import parse_budget
from ..errors import VTokenError
from ..provenance import run_info
from ..registry import method_class
from ..specs import build_methods, method_names, parse_param
from ..stats import Estimate, mean_estimate, ratio_estimate
from ..timing import DEFAULT_REPEATS, Timing, compare, time_to_first_token
from . import tasks_path


@dataclass
class Setting:
    """One point of the sweep: `method` ("none" = unpatched) with `params` (routed as in `--model_args`)."""

    method: str
    budget: float | int | None
    params: dict[str, Any]
    scores: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)
    samples: dict[str, dict[Any, float]] = field(default_factory=dict)  # "task/metric" -> doc id -> score
    ttft: Timing | None = None  # time to first token on the task's first batch, interleaved with every setting

    def methods(self) -> list:
        """Fresh method objects of this setting (none for the unpatched model)."""
        return build_methods(None if self.method == "none" else self.method, self.params, [], source="--param")

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"


def settings(methods: list[str], budgets: list[float | int], extra: dict[str, Any]) -> list[Setting]:
    """The sweep's points, every one validated (methods built) before anything runs."""
    out = [Setting("none", None, {})]
    for method in methods:
        names = method_names(method)
        knobs = {}  # the parameter each budget sets (`Method.budget_param`): `budget`, or FastV's `keep`
        for name in names:
            knob = method_class(name).budget_param
            if knob is not None:
                knobs[f"{name}.{knob}"] = None
        mine = {k: v for k, v in extra.items() if _applies(k, names)}
        for budget in budgets if knobs else [None]:
            params = {k: budget for k in knobs} if knobs else {}
            params.update(mine)
            build_methods(method, params, [], source="--param")
            out.append(Setting(method, budget, params))
    used = {k for k in extra if any(_applies(k, method_names(m)) for m in methods)}
    if set(extra) - used:
        raise VTokenError(f"--param {sorted(set(extra) - used)} applies to none of the methods {methods}")
    return out


def _applies(key: str, names: list[str]) -> bool:
    """Whether `--param key=...` concerns a setting of the methods `names` (`fastv.layer` only FastV's)."""
    prefix, dot, param = key.partition(".")
    if dot:
        cls = method_class(prefix)
        return cls is not None and cls.name in names
    return any(key in method_class(n).__dataclass_fields__ for n in names)


def _scores(results: dict, task_names: list[str]) -> dict[str, float]:
    """`task/metric` -> value for every metric of the evaluated tasks (lmms-eval's `metric,filter` keys)."""
    out = {}
    for task in task_names:
        for key, value in results.get("results", {}).get(task, {}).items():
            if "," in key and "stderr" not in key and isinstance(value, (int, float)):
                out[f"{task}/{key.split(',')[0]}"] = float(value)
    return out


def _per_sample(results: dict, task_names: list[str], scores: dict[str, float]) -> dict[str, dict[Any, float]]:
    """ "task/metric" -> {doc id: that sample's score} from lmms-eval's samples log (a metric key of a sample is
    the metric's name: `accuracy` for `accuracy,none`)."""
    out: dict[str, dict[Any, float]] = {}
    for key in scores:
        task, metric = key.split("/", 1)
        values = {}
        for sample in results.get("samples", {}).get(task, []):
            value = sample.get(metric)
            if isinstance(value, (int, float)):  # bools too: a yes/no metric scores 0 or 1
                values[sample["doc_id"]] = float(value)
        if values:
            out[key] = values
    return out


def estimates(point: Setting, base: Setting) -> dict[str, dict[str, Estimate | None]]:
    """Per "task/metric": the setting's score and its retention against `base` (the unpatched model) on the same
    samples, each with n, standard error and 95 % interval (`vtoken.stats`)."""
    out = {}
    for key, values in point.samples.items():
        reference = base.samples.get(key, {})
        shared = [d for d in values if d in reference]
        out[key] = {
            "score": mean_estimate(list(values.values())),
            "retention": ratio_estimate([values[d] for d in shared], [reference[d] for d in shared])
            if shared
            else None,
        }
    return out


def run(args: argparse.Namespace) -> int:
    """The `vtoken eval` subcommand."""
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager
    from tqdm import tqdm

    from .lmms_model import VTokenLMM
    from .records import run_means

    methods = [m for m in args.methods.split(",") if m]
    budgets = [parse_budget(b) for b in args.budgets.split(",") if b]
    extra = dict(parse_param(p) for p in args.param)
    points = settings(methods, budgets, extra)
    task_names = [t for t in args.tasks.split(",") if t]
    include = [str(tasks_path()), *args.include_path]
    manager = TaskManager("WARNING", include_path=include, include_defaults=False, model_name="vtoken")
    if not set(task_names) <= set(manager.all_tasks):  # a built-in lmms-eval task: index those too (slower)
        manager = TaskManager("WARNING", include_path=include, model_name="vtoken")
    missing = sorted(set(task_names) - set(manager.all_tasks))
    if missing:
        raise VTokenError(f"unknown task(s) {missing}; the task pack has {', '.join(_pack_tasks(manager))}")

    lm = VTokenLMM(pretrained=args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype)
    for point in points:  # every setting must patch this model before the first one runs
        lm.set_methods(point.methods(), args.layout)
    lm.set_methods([])
    out = Path(args.out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    for point in tqdm(points, desc="vtoken eval settings"):
        lm.set_methods(point.methods(), args.layout)
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=task_names,
            limit=args.limit,
            batch_size=args.batch_size,
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
            verbosity="WARNING",
        )
        point.scores = _scores(results, task_names)
        point.samples = _per_sample(results, task_names, point.scores)
        point.means = run_means(lm.last_run)
        name = re.sub(r"[^A-Za-z0-9_.@+-]", "_", point.label)
        with open(out / "samples" / f"{name}.jsonl", "w") as f:
            for task in task_names:
                for sample in results.get("samples", {}).get(task, []):
                    f.write(json.dumps({"task": task, **sample}, default=str) + "\n")
    lm.set_methods([])
    if lm.timing_inputs is not None:
        time_settings(lm, points, args.layout, args.repeats)

    report = {
        "environment": run_info(lm.device),
        "model": args.model,
        "tasks": task_names,
        "limit": args.limit,
        "layout": args.layout,
        "settings": [
            {
                "method": p.method,
                "budget": p.budget,
                "params": p.params,
                "scores": p.scores,
                "estimates": {
                    k: {name: e.to_dict() if e else None for name, e in v.items()}
                    for k, v in estimates(p, points[0]).items()
                },  # fmt: skip
                "means": p.means,
                "ttft": p.ttft.to_dict() if p.ttft else None,
                "ttft_vs_unpatched": compare(points[0].ttft, p.ttft).to_dict() if p.ttft and i else None,
            }
            for i, p in enumerate(points)
        ],
    }
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    table = retention_table(points)
    (out / "sweep.md").write_text(f"# vtoken eval: {args.model} on {', '.join(task_names)}\n\n{table}\n")
    plot(points, out / "sweep.png", title=f"{args.model}: {', '.join(task_names)}")
    print(table)
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}, {out / 'samples'}/")
    return 0


def time_settings(lm, points: list[Setting], layout: str, repeats: int) -> None:
    """Time to first token of every setting on the first batch the task gave (`lm.timing_inputs`), under
    `vtoken.timing`'s rule: settings interleaved after a warm-up, `repeats` runs each (the per-batch times of
    the accuracy runs are sequential, so they are not compared)."""

    def patched(point: Setting):
        @contextmanager
        def context():
            lm.set_methods(point.methods(), layout)
            try:
                yield
            finally:
                lm.set_methods([])

        return context

    import torch

    with torch.inference_mode():
        timed = time_to_first_token(lm.model, lm.timing_inputs, {p.label: patched(p) for p in points}, repeats)
    for point in points:
        point.ttft = timed[point.label]


def _pack_tasks(manager) -> list[str]:
    return sorted(t for t in manager.all_tasks if t.startswith("vtoken_"))


def retention_table(points: list[Setting]) -> str:
    """Markdown: per setting, kept visual tokens, every score and its retention vs the unpatched model, each as
    value ± standard error [95 % interval] with n, selection ms and TTFT under the timing rule."""
    base = points[0]
    metrics = list(base.scores)
    n = {m: len(base.samples.get(m, {})) for m in metrics}
    head = ["setting", "visual tokens (LLM input)", *(f"{m} (n={n[m]})" for m in metrics),
            *(f"retention {m}" for m in metrics), "selection ms", "TTFT (median, min-max)", "TTFT speedup"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        found = estimates(p, base)
        kept = p.means.get("vtoken_visual_kept", float("nan"))
        scores, retention = [], []
        for m in metrics:
            e = found.get(m, {})
            score = e.get("score")
            scores.append(score.text() if score else f"{p.scores.get(m, float('nan')):.3f} (no per-sample scores)")
            r = e.get("retention")
            retention.append(r.text() if r else "n/a")
        ttft = p.ttft.ms() if p.ttft else "n/a"
        speedup = "(baseline)" if p is base else str(compare(base.ttft, p.ttft)) if p.ttft else "n/a"
        cells = [p.label, f"{kept:.1f}", *scores, *retention, f"{p.means.get('vtoken_selection_ms', 0):.2f}",
                 ttft, speedup]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Scores and retentions: value ± standard error [95 % interval] n=samples (Wilson's interval for 0/1 "
                 "scores; retention: paired delta method on the same samples).")  # fmt: skip
    return "\n".join(lines)


def plot(points: list[Setting], path: Path, title: str) -> None:
    """Write `figure(points, title)` to `path`."""
    import matplotlib.pyplot as plt

    fig = figure(points, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(points: list[Setting], title: str):
    """Score (the first task's first metric) vs mean visual tokens of the LLM's input, one line per method with
    its 95 % intervals; markers, line styles and small horizontal offsets keep lines that coincide visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    metric = next(iter(points[0].scores), None)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    if metric is not None:
        base = points[0]
        ax.axhline(base.scores[metric], color="grey", linestyle="--", label="unpatched")
        methods = list(dict.fromkeys(p.method for p in points[1:]))
        for i, method in enumerate(methods):
            mine = sorted((p for p in points if p.method == method), key=lambda p: p.means.get("vtoken_visual_kept", 0))
            offset = 1 + 0.03 * (i - (len(methods) - 1) / 2)  # log-x offsets: equal points side by side
            xs = [p.means.get("vtoken_visual_kept", 0) * offset for p in mine]
            ys = [p.scores.get(metric, float("nan")) for p in mine]
            errors = [[0.0, 0.0] for _ in mine]
            for e, p in zip(errors, mine, strict=True):
                est = estimates(p, base).get(metric, {}).get("score")
                if est is not None:
                    e[:] = [est.value - est.low, est.high - est.value]
            ax.errorbar(xs, ys, yerr=list(zip(*errors, strict=True)) if errors else None, capsize=2, label=method,
                        **line_style(i))  # fmt: skip
        ax.set_ylabel(f"{metric} (95 % interval)")
        ax.set_xscale("log")
        kept = [p.means.get("vtoken_visual_kept", 0) for p in points if p.means.get("vtoken_visual_kept", 0) > 0]
        if kept:  # some room around the points, and plain numbers on the axis (offsets stay small)
            ax.set_xlim(min(kept) / 1.5, max(kept) * 1.5)
            ax.set_xticks(sorted({round(k) for k in kept}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("visual tokens of the LLM's input (mean per sample)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", ":")


def line_style(i: int) -> dict:
    """The i-th line's marker and line style (cycled so no two of the first 10 look alike)."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)], "markersize": 5,
            "alpha": 0.85}  # fmt: skip


def add_parser(sub) -> None:
    """Register `vtoken eval` on the CLI's subparsers."""
    p = sub.add_parser("eval", help="sweep methods x budgets through lmms-eval (one process, one model load)")
    p.add_argument("--model", default="vtoken-mini", help="built-in name, checkpoint dir or hub id")
    p.add_argument("--tasks", default="vtoken_mini_vqa", help="lmms-eval tasks, comma-separated")
    p.add_argument("--methods", default="fastervlm,random,pool", help="methods, comma-separated (a+b composes)")
    p.add_argument("--budgets", default="0.5,0.25,0.1", help="fractions kept or token counts, comma-separated")
    p.add_argument("--param", action="append", default=[], help="extra method parameter NAME=VALUE (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="samples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layout", default="native", choices=("native", "official"))
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--include-path", action="append", default=[], help="more lmms-eval task directories")
    p.add_argument("--out", default="vtoken-eval", help="output directory")
    p.add_argument(
        "--repeats",
        "--runs",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed runs per setting for TTFT (interleaved after a warm-up; median and min-max)",
    )
    p.set_defaults(func=run)
