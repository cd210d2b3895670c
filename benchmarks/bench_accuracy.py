"""Accuracy retention on vtoken-mini and the procedural VQA test split: every method at 50/25/10/5 % budgets.

    python benchmarks/bench_accuracy.py [--questions 250] [--threads 1]

For every method that patches LLaVA-1.5 (`random` and `pool` are methods too) and every budget: accuracy per
question type, retention (pruned accuracy / unpruned accuracy) and what was kept: visual tokens, and the share of
the answer's object pixels (`target kept`) and of all object pixels (`objects kept`) that lie in kept patches; the
drawing parameters say exactly where the answer is, so these two say which tokens a method keeps whatever the
model's accuracy. `oracle` keeps the question's target patches first, then the other objects', by pixel coverage.
Every accuracy and retention comes with n, its standard error and a 95 % interval (`vtoken.stats`). Writes
<out>/accuracy_cpu.{json,md,png} (`--out`, default outside the repository; the shipped table is
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out, environment, write_results  # noqa: E402

import vtoken  # noqa: E402
from vtoken.mini import vqa  # noqa: E402
from vtoken.mini.evaluate import Result, evaluate  # noqa: E402
from vtoken.mini.model import load  # noqa: E402
from vtoken.registry import method_class  # noqa: E402
from vtoken.stats import mean_estimate, ratio_estimate  # noqa: E402

BUDGETS = (0.5, 0.25, 0.1, 0.05)


@dataclass
class Oracle(vtoken.ScoreMethod):
    """Keeps the question's target patches, then other objects', then background; scores queued per batch."""

    queue: list = field(default_factory=list)

    name = "oracle"

    def score(self, tokens: vtoken.VisualTokens) -> torch.Tensor:
        scores = self.queue.pop(0)
        assert scores.shape == (tokens.num_crops, tokens.num_tokens), "oracle scores out of step with the batches"
        return scores.to(tokens.features.device)


# vtoken-mini's LLM has 4 layers: the multi-stage methods' schedules shrunk to it, every LLM-stage method ending
# with `budget` of the 144 tokens in its last layers (FastV and DART: their `keep`; PyramidDrop halving per stage,
# as its default does; SparseVLM: its 192-token table scaled so that its last stage keeps budget x 144, plus the
# tokens it recycles)
SCHEDULES = {
    "pyramiddrop": lambda b: vtoken.PyramidDrop(layers=(1, 2, 3), ratios=(min(1.0, 4 * b), min(1.0, 2 * b), b)),
    "sparsevlm": lambda b: vtoken.SparseVLM(
        layers=(0, 1, 2), keep=tuple(min(144, max(1, round(k * b * 144 / 110))) for k in (300, 200, 110))
    ),
}


# methods whose official setting cannot run on vtoken-mini, as the documented variant that can (the row says which)
VARIANTS = {  # CDPruner's official relevance needs the CLIP text tower of the model's vision tower: vtoken-mini's
    # tower was trained with one that is not shipped, so it runs as CDPruner-LLM (vtoken's variant)
    "cdpruner": ("cdpruner (relevance='llm')", lambda b: vtoken.CDPruner(budget=b, relevance="llm")),
}


def label(method: str) -> str:
    """The method's row in the tables: its name, or its variant's label."""
    return VARIANTS[method][0] if method in VARIANTS else method


def make(method: str, budget: float):
    """The method at `budget`: its declared `budget_param` (its `budget`, or `keep` for LLM-stage methods: FastV,
    DART), or its schedule (`SCHEDULES`) or variant (`VARIANTS`); VTokenError if it has no token-count knob
    (threshold-driven MustDrop)."""
    if method in SCHEDULES:
        return SCHEDULES[method](budget)
    if method in VARIANTS:
        return VARIANTS[method][1](budget)
    names = {f.name for f in fields(method_class(method))}
    knob = method_class(method).budget_param
    if knob is None:
        raise vtoken.VTokenError(f"{method} has no token budget (parameters: {', '.join(sorted(names))})")
    return vtoken.make_method(method, **{knob: budget})


def oracle_scores(pairs: list[tuple[int, vqa.Question]], batch: int) -> list[torch.Tensor]:
    """Per batch [B, 144]: 10 x target coverage + all-object coverage + a tiny fixed tie-break."""
    rows = []
    for index, q in pairs:
        coverage = vqa.patch_coverage(vqa.scene("test", index))
        target = coverage[list(q.targets)].sum(0) if q.targets else 0
        rows.append(torch.tensor(10 * target + coverage.sum(0) + 1e-6 * np.arange(coverage.shape[1])[::-1]))
    return [torch.stack(rows[i : i + batch]).float() for i in range(0, len(rows), batch)]


def pixels_kept(result: Result, pairs: list[tuple[int, vqa.Question]]) -> dict[str, float | None]:
    """Mean share of the target's and of all objects' pixels that lie in kept patches (None: merging method)."""
    if any(k is None for k in result.kept):
        return {"target_kept": None, "objects_kept": None}
    target, objects = [], []
    for kept, (index, q) in zip(result.kept, pairs, strict=True):
        coverage = vqa.patch_coverage(vqa.scene("test", index))
        if q.targets:
            target.append(coverage[list(q.targets)][:, kept].sum() / coverage[list(q.targets)].sum())
        objects.append(coverage[:, kept].sum() / coverage.sum())
    return {"target_kept": float(np.mean(target)), "objects_kept": float(np.mean(objects))}


def estimates(result: Result, base: Result) -> dict[str, dict]:
    """Per question type and "all": accuracy and retention (against `base` on the same questions), each with n,
    standard error and 95 % interval."""
    out = {}
    for kind in [*vqa.QUESTION_TYPES, "all"]:
        rows = [i for i, k in enumerate(result.kinds) if kind in ("all", k)]
        ours = [float(result.correct[i]) for i in rows]
        theirs = [float(base.correct[i]) for i in rows]
        retention = ratio_estimate(ours, theirs)
        out[kind] = {"accuracy": mean_estimate(ours).to_dict(), "retention": retention.to_dict() if retention else None}
    return out


def run(args: argparse.Namespace) -> dict:
    model, processor = load()
    pairs = vqa.question_set("test", args.questions)
    began = time.perf_counter()
    base = evaluate(model, processor, pairs, batch=args.batch)
    base_acc = base.accuracy()
    print("unpruned", {k: round(v, 3) for k, v in base_acc.items()}, flush=True)
    runs, skipped = [], {}
    for method in [*args.methods, "oracle"]:
        for budget in args.budgets:
            try:
                spec = Oracle(budget=budget, queue=oracle_scores(pairs, args.batch)) if method == "oracle" else None
                vtoken.patch(model, spec or make(method, budget))
            except vtoken.VTokenError as err:  # cannot apply to LLaVA-1.5, or has no budget: it says why
                skipped[method] = str(err)
                break
            try:
                start = time.perf_counter()
                result = evaluate(model, processor, pairs, batch=args.batch)
                seconds = time.perf_counter() - start
            finally:
                vtoken.unpatch(model)
            acc = result.accuracy()
            entry = {
                "method": label(method),
                "budget": budget,
                "tokens": float(np.mean(result.tokens)),
                "accuracy": acc,
                "retention": {k: acc[k] / base_acc[k] if base_acc[k] else None for k in acc},
                "estimates": estimates(result, base),
                **pixels_kept(result, pairs),
                "seconds": round(seconds, 1),
            }
            runs.append(entry)
            print(f"{method}@{budget}: accuracy {acc['all']:.3f} target kept {entry['target_kept']}", flush=True)
    return {
        "model": "vtoken-mini (vtoken/mini/weights)",
        "questions": args.questions,
        "question_types": list(vqa.QUESTION_TYPES),
        "visual_tokens": 144,
        "unpruned": {"accuracy": base_acc, "tokens": 144, "estimates": estimates(base, base)},
        "runs": runs,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - began),
        "environment": environment(torch.device("cpu")),
    }


def merged(earlier: dict, new: dict) -> dict:
    """`earlier`'s runs with `new`'s added (a method in both: `new`'s), in `earlier`'s method order; the unpruned
    model must have answered the same questions the same way (refused otherwise: the runs would not compare)."""
    if (earlier["questions"], earlier["unpruned"]["accuracy"]) != (new["questions"], new["unpruned"]["accuracy"]):
        raise SystemExit("--merge: the earlier results were not made on the same questions with the same answers")
    fresh = {r["method"] for r in new["runs"]} | set(new["skipped"])
    runs = [r for r in earlier["runs"] if r["method"] not in fresh and r["method"] != "oracle"]
    oracle = [r for r in new["runs"] if r["method"] == "oracle"] or [
        r for r in earlier["runs"] if r["method"] == "oracle"
    ]
    runs += [r for r in new["runs"] if r["method"] != "oracle"] + oracle
    skipped = {**{k: v for k, v in earlier["skipped"].items() if k not in fresh}, **new["skipped"]}
    seconds = earlier["seconds"] + new["seconds"]
    return {**earlier, "runs": runs, "skipped": skipped, "seconds": seconds, "environment": new["environment"]}


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def fmt_ci(estimate: dict | None) -> str:
    """'0.705 ± 0.035': a value and its standard error (the JSON has the 95 % interval and n)."""
    return "" if estimate is None else f"{estimate['value']:.3f} ± {estimate['se']:.3f}"


def table(payload: dict) -> str:
    types = payload["question_types"]
    budgets = sorted({r["budget"] for r in payload["runs"]}, reverse=True) or list(BUDGETS)
    methods = list(dict.fromkeys(r["method"] for r in payload["runs"]))
    by = {(r["method"], r["budget"]): r for r in payload["runs"]}
    lines = [
        f"vtoken-mini on {payload['questions']} procedural VQA test questions ({payload['questions'] // 5} per type), "
        f"{payload['visual_tokens']} visual tokens per image, greedy answers, {payload['seconds']} s.",
        "",
        "Unpruned accuracy (± standard error; 95 % intervals in the JSON): "
        + ", ".join(f"{k} {fmt_ci(payload['unpruned']['estimates'][k]['accuracy'])}" for k in [*types, "all"])
        + ".",
        "",
        f"Retention (pruned accuracy / unpruned accuracy on the same questions, ± standard error, n = "
        f"{payload['questions']}), all questions; in brackets the share of the answer's",
        "object pixels that lie in kept patches (target kept):",
        "",
        "| method | " + " | ".join(f"{b:.0%}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for method in methods:
        cells = []
        for b in budgets:
            r = by.get((method, b))
            kept = f" ({r['target_kept']:.2f})" if r and r["target_kept"] is not None else ""
            cells.append(fmt_ci(r["estimates"]["all"]["retention"]) + kept if r else "")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for budget in budgets:
        lines += [
            "",
            f"Budget {budget:.0%}: retention per question type (± standard error, n = {payload['questions'] // 5} "
            "per type); tokens kept; share of the answer's object pixels (target) and of all object pixels (objects) "
            "in kept patches:",
            "",
            "| method | tokens | " + " | ".join(types) + " | all | target kept | objects kept |",
            "|---|---:|" + "---:|" * (len(types) + 3),
        ]
        for method in methods:
            r = by.get((method, budget))
            if r is not None:
                cells = [fmt_ci(r["estimates"][k]["retention"]) for k in [*types, "all"]] + [
                    fmt(r["target_kept"]),
                    fmt(r["objects_kept"]),
                ]
                lines.append(f"| {method} | {r['tokens']:.0f} | " + " | ".join(cells) + " |")
    if payload["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{m}`: {why}" for m, why in payload["skipped"].items()]
    return "\n".join(lines)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", ":")


def plot(payload: dict, path: Path) -> None:
    """Write `figure(payload)` to `path`."""
    import matplotlib.pyplot as plt

    fig = figure(payload)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def figure(payload: dict):
    """Accuracy vs visual tokens kept, one line per method with its 95 % intervals; every method has its own marker
    and line style and a small horizontal offset, so methods with equal results (FasterVLM and HiRED on LLaVA-1.5)
    stay visible side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in payload["runs"]))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True)
    for ax, kind in zip(axes.flat, ["all", *payload["question_types"]], strict=True):
        for i, method in enumerate(methods):
            rows = sorted((r for r in payload["runs"] if r["method"] == method), key=lambda r: r["tokens"])
            offset = 1 + 0.035 * (i - (len(methods) - 1) / 2)  # log-x: equal points drawn side by side
            style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
                     "markersize": 4, "alpha": 0.85, "capsize": 2}  # fmt: skip
            if method == "oracle":
                style.update(color="grey", linestyle="--")
            ys = [r["estimates"][kind]["accuracy"]["value"] for r in rows]
            lows = [y - r["estimates"][kind]["accuracy"]["ci95"][0] for y, r in zip(ys, rows, strict=True)]
            highs = [r["estimates"][kind]["accuracy"]["ci95"][1] - y for y, r in zip(ys, rows, strict=True)]
            ax.errorbar([r["tokens"] * offset for r in rows], ys, yerr=[lows, highs], label=method, **style)
        ax.axhline(payload["unpruned"]["accuracy"][kind], color="black", lw=1, ls=":", label="unpruned (144)")
        ax.set_xscale("log")
        ax.set_xticks([7, 14, 36, 72, 144], labels=["7", "14", "36", "72", "144"])
        ax.set_title("all question types" if kind == "all" else kind)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("visual tokens kept (of 144)")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy (95 % interval)")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"vtoken-mini, procedural VQA test split ({payload['questions']} questions)")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=250)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument("--methods", nargs="+", default=vtoken.available_methods())
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="accuracy_cpu")
    parser.add_argument(
        "--merge", type=Path, default=None,
        help="an earlier results JSON (same questions): keep its runs, replace or add those of --methods",
    )  # fmt: skip
    add_out(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    payload = run(args)
    if args.merge is not None:
        payload = merged(json.loads(args.merge.read_text()), payload)
    json_path, md_path = write_results(args.name, payload, table(payload), args.out)
    plot(payload, args.out / f"{args.name}.png")
    print(table(payload))
    print(f"wrote {json_path}, {md_path}, {args.out / (args.name + '.png')}")


if __name__ == "__main__":
    main()
