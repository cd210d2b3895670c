"""Accuracy retention on vtoken-mini and the procedural VQA test split: every method at 50/25/10/5 % budgets.

    python benchmarks/bench_accuracy.py [--questions 250] [--threads 1]

For every method that patches LLaVA-1.5 (`random` and `pool` are methods too) and every budget: accuracy per
question type, retention (pruned accuracy / unpruned accuracy) and what was kept: visual tokens, and the share of
the answer's object pixels (`target kept`) and of all object pixels (`objects kept`) that lie in kept patches; the
drawing parameters say exactly where the answer is, so these two say which tokens a method keeps whatever the
model's accuracy. `oracle` keeps the question's target patches first, then the other objects', by pixel coverage.
Writes results/accuracy_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment, write_results  # noqa: E402

import vtoken  # noqa: E402
from vtoken.mini import vqa  # noqa: E402
from vtoken.mini.evaluate import Result, evaluate  # noqa: E402
from vtoken.mini.model import load  # noqa: E402
from vtoken.registry import METHODS  # noqa: E402

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


def make(method: str, budget: float):
    """The method at `budget`: its `budget` field, or `keep` for LLM-stage methods (FastV); VTokenError if it has
    no token-count knob (threshold-driven MustDrop)."""
    names = {f.name for f in fields(METHODS[method])}
    knob = next((k for k in ("budget", "keep") if k in names), None)
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


def run(args: argparse.Namespace) -> dict:
    model, processor = load()
    pairs = vqa.question_set("test", args.questions)
    began = time.perf_counter()
    base_acc = evaluate(model, processor, pairs, batch=args.batch).accuracy()
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
                "method": method,
                "budget": budget,
                "tokens": float(np.mean(result.tokens)),
                "accuracy": acc,
                "retention": {k: acc[k] / base_acc[k] if base_acc[k] else None for k in acc},
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
        "unpruned": {"accuracy": base_acc, "tokens": 144},
        "runs": runs,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - began),
        "environment": environment(torch.device("cpu")),
    }


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def table(payload: dict) -> str:
    types = payload["question_types"]
    base = payload["unpruned"]["accuracy"]
    methods = list(dict.fromkeys(r["method"] for r in payload["runs"]))
    by = {(r["method"], r["budget"]): r for r in payload["runs"]}
    lines = [
        f"vtoken-mini on {payload['questions']} procedural VQA test questions ({payload['questions'] // 5} per type), "
        f"{payload['visual_tokens']} visual tokens per image, greedy answers, {payload['seconds']} s.",
        "",
        "Unpruned accuracy: " + ", ".join(f"{k} {base[k]:.3f}" for k in [*types, "all"]) + ".",
        "",
        "Retention (pruned accuracy / unpruned accuracy), all questions; in brackets the share of the answer's",
        "object pixels that lie in kept patches (target kept):",
        "",
        "| method | " + " | ".join(f"{b:.0%}" for b in BUDGETS) + " |",
        "|---|" + "---:|" * len(BUDGETS),
    ]
    for method in methods:
        cells = []
        for b in BUDGETS:
            r = by.get((method, b))
            kept = f" ({r['target_kept']:.2f})" if r and r["target_kept"] is not None else ""
            cells.append(fmt(r["retention"]["all"]) + kept if r else "")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for budget in BUDGETS:
        lines += [
            "",
            f"Budget {budget:.0%}: retention per question type; tokens kept; share of the answer's object pixels "
            "(target) and of all object pixels (objects) in kept patches:",
            "",
            "| method | tokens | " + " | ".join(types) + " | all | target kept | objects kept |",
            "|---|---:|" + "---:|" * (len(types) + 3),
        ]
        for method in methods:
            r = by.get((method, budget))
            if r is not None:
                cells = [fmt(r["retention"][k]) for k in [*types, "all"]] + [
                    fmt(r["target_kept"]),
                    fmt(r["objects_kept"]),
                ]
                lines.append(f"| {method} | {r['tokens']:.0f} | " + " | ".join(cells) + " |")
    if payload["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{m}`: {why}" for m, why in payload["skipped"].items()]
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in payload["runs"]))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True)
    for ax, kind in zip(axes.flat, ["all", *payload["question_types"]], strict=True):
        for method in methods:
            rows = sorted((r for r in payload["runs"] if r["method"] == method), key=lambda r: r["tokens"])
            style = dict(ls="--", color="grey") if method == "oracle" else {}
            ax.plot([r["tokens"] for r in rows], [r["accuracy"][kind] for r in rows], "o-", label=method, **style)
        ax.axhline(payload["unpruned"]["accuracy"][kind], color="black", lw=1, ls=":", label="unpruned (144)")
        ax.set_xscale("log")
        ax.set_xticks([7, 14, 36, 72, 144], labels=["7", "14", "36", "72", "144"])
        ax.set_title("all question types" if kind == "all" else kind)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("visual tokens kept (of 144)")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"vtoken-mini, procedural VQA test split ({payload['questions']} questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=250)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument("--methods", nargs="+", default=vtoken.available_methods())
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="accuracy_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    payload = run(args)
    json_path, md_path = write_results(args.name, payload, table(payload))
    plot(payload, RESULTS / f"{args.name}.png")
    print(table(payload))
    print(f"wrote {json_path}, {md_path}, {RESULTS / (args.name + '.png')}")


if __name__ == "__main__":
    main()
