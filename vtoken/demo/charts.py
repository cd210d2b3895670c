"""The page's charts (matplotlib): visual tokens per stage, and accuracy against kept tokens for the sweep."""

from __future__ import annotations

from ..stats import Estimate
from .runs import SweepPoint


def tokens_figure(chart: list[tuple[str, str, int]]):
    """Grouped bars: visual tokens after every stage, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(c for c, _, _ in chart))
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(labels)))
    stages = sorted(dict.fromkeys(s for _, s, _ in chart), key=_stage_order)
    height = 0.8 / max(len(stages), 1)
    for j, stage in enumerate(stages):
        ys, ns = [], []
        for i, label in enumerate(labels):
            for c, s, n in chart:
                if c == label and s == stage:
                    ys.append(i + (j - (len(stages) - 1) / 2) * height)
                    ns.append(n)
        ax.barh(ys, ns, height=height, label=stage)
    ax.set_yticks(range(len(labels)), labels=[lab if len(lab) < 48 else lab[:45] + "..." for lab in labels])
    ax.invert_yaxis()
    ax.set_xlabel("visual tokens (first image or video)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _stage_order(stage: str) -> tuple:
    """input, then encoder stages, then the LLM's drop layers in depth order."""
    if stage == "input":
        return (0, 0, stage)
    if stage.startswith("prefill.layer"):
        return (2, int(stage.removeprefix("prefill.layer")), stage)
    return (1, 0, stage)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", ":")


def sweep_figure(base: Estimate, points: list[SweepPoint]):
    """Accuracy (95 % intervals) vs visual tokens kept, one line per method; each method its own marker, line
    style and a small x offset, so equal results stay visible side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(dict.fromkeys(p.method for p in points))
    for i, method in enumerate(methods):
        mine = sorted((p for p in points if p.method == method), key=lambda p: p.tokens)
        offset = 1 + 0.035 * (i - (len(methods) - 1) / 2)
        errors = [[p.accuracy - p.estimate.low for p in mine], [p.estimate.high - p.accuracy for p in mine]]
        ax.errorbar([p.tokens * offset for p in mine], [p.accuracy for p in mine], yerr=errors, capsize=2,
                    marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)], markersize=5,
                    alpha=0.85, label=method)  # fmt: skip
    ax.axhline(base.value, color="black", ls=":", label=f"unpruned (144 tokens), n={base.n}")
    ax.set_xscale("log")
    ax.set_xticks([7, 14, 36, 72, 144], labels=["7", "14", "36", "72", "144"])
    ax.set_xlabel("visual tokens kept (of 144)")
    ax.set_ylabel("accuracy (95 % interval)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
