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
from ..registry import method_class
from ..specs import build_methods, method_names, parse_param
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
        knobs = {}  # the stage parameter each budget sets: `budget`, or FastV's `keep`
        for name in names:
            accepted = {f for f in method_class(name).__dataclass_fields__}
            knob = next((k for k in ("budget", "keep") if k in accepted), None)
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
    """Markdown: per setting, kept visual tokens, every score, its retention vs the unpatched model, selection
    ms and TTFT."""
    base = points[0].scores
    metrics = list(base)
    head = ["setting", "kept tokens", *metrics, *(f"retention {m}" for m in metrics), "selection ms",
            "TTFT (median, min-max)", "TTFT speedup"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        kept = p.means.get("vtoken_visual_kept", float("nan"))
        scores = [f"{p.scores.get(m, float('nan')):.3f}" for m in metrics]
        retention = [f"{p.scores.get(m, float('nan')) / base[m]:.1%}" if base[m] else "n/a" for m in metrics]
        ttft = p.ttft.ms() if p.ttft else "n/a"
        speedup = "(baseline)" if p is points[0] else str(compare(points[0].ttft, p.ttft)) if p.ttft else "n/a"
        cells = [p.label, f"{kept:.1f}", *scores, *retention, f"{p.means.get('vtoken_selection_ms', 0):.2f}",
                 ttft, speedup]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: list[Setting], path: Path, title: str) -> None:
    """Accuracy (the first task's first metric) vs mean kept visual tokens, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next(iter(points[0].scores), None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if metric is not None:
        base = points[0]
        ax.axhline(base.scores[metric], color="grey", linestyle="--", label="unpatched")
        for method in dict.fromkeys(p.method for p in points[1:]):
            mine = sorted((p for p in points if p.method == method), key=lambda p: p.means.get("vtoken_visual_kept", 0))
            xs = [p.means.get("vtoken_visual_kept", 0) for p in mine]
            ax.plot(xs, [p.scores.get(metric, float("nan")) for p in mine], marker="o", label=method)
        ax.set_ylabel(metric)
    ax.set_xlabel("visual tokens kept (mean per sample)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
