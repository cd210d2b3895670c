"""Benchmarks: results go to `--out` (default outside the repository, so `make bench` never overwrites the shipped
tables), every results JSON records versions, commit, device and date, accuracies carry n / standard error /
95 % interval, and plots keep every method's line visible."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SHIPPED = BENCH / "results"


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_default_output_is_outside_the_repository():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    assert not common.DEFAULT_OUT.resolve().is_relative_to(ROOT)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_every_benchmark_takes_out_and_never_writes_the_shipped_folder_itself(script):
    source = (BENCH / script).read_text()
    assert "add_out(" in source or "ttft_parser(" in source, f"{script} takes no --out"
    assert "RESULTS" not in source, f"{script} writes to benchmarks/results/ directly"


def test_accuracy_benchmark_writes_to_out_with_provenance_and_intervals(tmp_path):
    before = _digest(SHIPPED)
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_accuracy.py"), "--questions", "5", "--batch", "5", "--budgets", "0.25",
         "--methods", "random", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert _digest(SHIPPED) == before  # the shipped tables are untouched
    payload = json.loads((tmp_path / "accuracy_cpu.json").read_text())
    env = payload["environment"]
    assert {"date", "vtoken", "commit", "torch", "transformers", "python", "device"} <= set(env)
    assert env["commit"] is None or len(env["commit"]) == 40
    run = payload["runs"][0]
    accuracy = run["estimates"]["all"]["accuracy"]
    assert accuracy["n"] == 5 and accuracy["value"] == pytest.approx(run["accuracy"]["all"])
    assert accuracy["ci95"][0] <= accuracy["value"] <= accuracy["ci95"][1]
    assert " ± " in (tmp_path / "accuracy_cpu.md").read_text()
    assert (tmp_path / "accuracy_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_accuracy_plot_keeps_equal_lines_apart():
    """Two methods with identical results (as FasterVLM and HiRED on LLaVA-1.5) get different markers and line
    styles and do not sit on the same x positions."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_accuracy
    finally:
        sys.path.remove(str(BENCH))
    kinds = ["colour", "shape", "count", "presence", "read"]
    est = {"value": 0.5, "se": 0.1, "ci95": [0.3, 0.7], "n": 10}
    runs = [{"method": m, "budget": b, "tokens": t, "estimates": {k: {"accuracy": est} for k in [*kinds, "all"]}}
            for m in ("fastervlm", "hired") for b, t in ((0.25, 36), (0.05, 7))]  # fmt: skip
    payload = {"runs": runs, "question_types": kinds, "questions": 10,
               "unpruned": {"accuracy": dict.fromkeys([*kinds, "all"], 0.9)}}  # fmt: skip
    fig = bench_accuracy.figure(payload)
    bars = [c for c in fig.axes[0].containers if c.get_label() in ("fastervlm", "hired")]  # errorbar containers
    assert len(bars) == 2
    a, b = (c.lines[0] for c in bars)  # each one's data line
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())
    assert all(x != y for x, y in zip(a.get_xdata(), b.get_xdata(), strict=True))
