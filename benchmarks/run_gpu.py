"""Everything a GPU can tell about vtoken, in one offline command: `make bench-gpu PYTHON=python3`.

On a machine with one CUDA GPU and its own Python (torch >= 2.11, triton >= 3.6; vtoken and transformers installed
from wheels with `--no-deps`, docs: "Run the GPU benchmarks"), it creates no environment and downloads nothing:

1. the CUDA tests: every kernel against its reference on the GPU, sync debug mode around selections, drops and a
   patched `generate` per method, CUDA-graph capture, the sm_90 compile checks (tests/, `CUDA_TESTS`);
2. every GPU benchmark (`STEPS`), full depth, bf16, results into `--out` (`*_cuda.json` / `.md`);
3. one summary, `summary_cuda.md` / `.json`: the GPU's name and versions, each step's status and time, per method
   its TTFT against unpatched and the oracle and its selection's share at batch 1/8/32, the LLM stages at batch
   1/8/32, sparse prefill against dense, and every target of issue 40 with its value and pass/fail.

Each step runs in its own process under its own timeout, within one overall budget (`--budget-s`, 480 s: the whole
run fits 8 minutes on an H100/H200); a step that fails or times out is reported and the next one runs. The steps run
from a scratch folder (`--out`/work), so an installed vtoken is what they import even when this repository (which
holds a `vtoken/` folder) is the current directory. `--archive FILE` packs the results after every step (what a
lent machine can send back: one file).

`--device cpu` runs the same steps at tiny shapes (`--tiny` on every benchmark, the CUDA tests collected but not
run): `tests/test_gpu_benchmarks.py` runs it end to end, so the GPU path cannot rot where no GPU is lent.

    python benchmarks/run_gpu.py                                # on the GPU machine (make bench-gpu)
    python benchmarks/run_gpu.py --device cpu --out /tmp/smoke  # the CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TESTS = ROOT / "tests"
# the CUDA tests (they skip without a GPU) and the sm_90 compile checks (they run anywhere ptxas does)
CUDA_TEST_FILES = ("test_kernels.py", "test_selection_kernels.py", "test_video_kernels.py",
                   "test_visual_attention_kernel.py", "test_block_sparse_kernel.py", "test_launches.py",
                   "test_llm_launches.py", "test_selection_launches.py", "test_cuda_implementations.py",
                   "test_cuda_generate.py")  # fmt: skip
CUDA_TESTS = "on_cuda or h100 or cuda_implementation"
MIN_TORCH, MIN_TRITON = (2, 11), (3, 6)


@dataclass(frozen=True)
class Step:
    """One step: `argv(device, tiny, repeats, out)` after the interpreter, its timeout, the results it writes (file
    stems, without the device suffix)."""

    name: str
    argv: Callable[[str, bool, int, Path], list[str]]
    timeout_s: int
    results: tuple[str, ...] = ()


def _tests(device: str, tiny: bool, repeats: int, out: Path) -> list[str]:
    files = [str(TESTS / name) for name in CUDA_TEST_FILES]
    argv = [
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        CUDA_TESTS,
        f"--junitxml={out / 'logs' / 'tests.xml'}",
    ]
    return argv + (["--collect-only"] if tiny else []) + files


def _bench(script: str, gpu: list[str], tiny: list[str]) -> Callable[[str, bool, int, Path], list[str]]:
    def argv(device: str, smoke: bool, repeats: int, out: Path) -> list[str]:
        extra = [a.format(device=device) for a in (tiny if smoke else gpu)]
        return [str(BENCH / script), "--device", device, "--repeats", str(repeats), "--out", str(out), *extra] + (
            ["--tiny"] if smoke else []
        )

    return argv


# most important first: when the budget runs out, what is left out is the least needed
STEPS = (
    Step("cuda-tests", _tests, 150),
    Step(
        "methods",
        _bench("bench_methods.py", ["--budgets", "0.5", "0.25", "0.1"], ["--budgets", "0.25", "--frames", "2"]),
        120,
        ("methods",),
    ),  # fmt: skip
    Step(
        "llava15-batches",
        _bench(
            "bench_llava.py",
            ["--batch", "1", "8", "32", "--budgets", "0.25", "--methods", "all", "--name", "llava15_batch_{device}"],
            [
                "--batch",
                "1",
                "2",
                "--budgets",
                "0.25",
                "--methods",
                "all",
                "--llm-layers",
                "1",
                "--name",
                "llava15_batch_{device}",
            ],
        ),
        100,
        ("llava15_batch",),
    ),  # fmt: skip
    Step(
        "llm-stages",
        _bench("bench_llm_stages.py", [], ["--batches", "1,2", "--decode-tokens", "2", "--frames", "2"]),
        100,
        ("llm_stages", "llm_stages_video"),
    ),  # fmt: skip
    Step("sparse-prefill", _bench("bench_sparse_prefill.py", [], []), 90, ("sparse_prefill",)),
    Step(
        "families",
        _bench("bench_families.py", ["--budgets", "0.25"], ["--budgets", "0.25", "--frames", "2"]),
        50,
        ("families",),
    ),  # fmt: skip
    Step(
        "qwen3-vl",
        _bench("bench_qwen3_vl.py", ["--budgets", "0.25"], ["--budgets", "0.25", "--frames", "4"]),
        45,
        ("qwen3_vl",),
    ),  # fmt: skip
    Step("tower", _bench("bench_tower.py", [], []), 90, ("tower", "tower_ttft")),
)


# --------------------------------------------------------------------- environment
def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def environment(device: str) -> dict:
    """What this run runs on, checked: torch and triton new enough, transformers inside vtoken's tested range, a
    CUDA GPU for `--device cuda`. Raises SystemExit naming what is missing and how to bring it."""
    problems = []
    info: dict = {"python": sys.version.split()[0], "device": device}
    try:
        import torch
    except ImportError:
        raise SystemExit("run_gpu: torch is not installed in this Python") from None
    info["torch"] = torch.__version__
    if device == "cuda":
        if not torch.cuda.is_available():
            problems.append("--device cuda, but torch sees no CUDA GPU")
        else:
            info["gpu"] = torch.cuda.get_device_name(0)
        if _version(torch.__version__) < MIN_TORCH:
            problems.append(f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}")
    try:
        import triton

        info["triton"] = triton.__version__
        if device == "cuda" and _version(triton.__version__) < MIN_TRITON:
            problems.append(f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}")
    except ImportError:
        info["triton"] = None
        if device == "cuda":
            problems.append('triton is not installed: vtoken\'s kernels need it (pip install "vtoken[kernels]")')
    try:
        import transformers

        info["transformers"] = transformers.__version__
        import vtoken
        from vtoken.adapters import hf

        info["vtoken"] = getattr(vtoken, "__version__", "?")
        info["vtoken_from"] = str(Path(vtoken.__file__).resolve().parent)
        low, high = hf.MIN_TESTED, hf.MAX_TESTED
        installed = _version(transformers.__version__)
        if not _version(low) <= installed <= _version(high):
            problems.append(f"transformers {transformers.__version__} is outside vtoken's tested range {low} to "
                            f"{high}: install its wheel with --no-deps (docs: Run the GPU benchmarks)")  # fmt: skip
    except ImportError as error:
        problems.append(f"{error.name or error} does not import: install vtoken and transformers from their wheels "
                        "(docs: Run the GPU benchmarks)")  # fmt: skip
    if problems:
        raise SystemExit("run_gpu: cannot run here:\n- " + "\n- ".join(problems))
    return info


# --------------------------------------------------------------------- running the steps
def run_step(step: Step, argv: list[str], timeout: float, log: Path, cwd: Path) -> dict:
    """Run one step in its own process group (a timeout ends all of it); its output goes to `log`."""
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as handle:
        handle.write(f"$ {sys.executable} {' '.join(argv)}\n")
        handle.flush()
        process = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"timed out after {timeout:.0f} s"
    return {"step": step.name, "status": status, "seconds": round(time.monotonic() - started, 1), "log": str(log)}


def pack(out: Path, device: str, archive: Path) -> None:
    """Results of this device, the summary and the logs as one .tar.gz (written next to itself, then renamed)."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(out.glob(f"*_{device}.*")) + sorted((out / "logs").glob("*")):
            tar.add(path, arcname=str(path.relative_to(out)))
    partial.replace(archive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: the real run; cpu: the same steps at tiny shapes (a smoke run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=BENCH / "results", help="results folder (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per config (default: 3 on cuda, 1 cpu)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's time limit in seconds (default: 480 on cuda, 3600 on cpu)")  # fmt: skip
    parser.add_argument("--steps", nargs="+", default=None, choices=[s.name for s in STEPS],
                        help="run only these steps (default: all)")  # fmt: skip
    parser.add_argument("--archive", type=Path, default=None, help="pack the results into this .tar.gz after each step")
    args = parser.parse_args(argv)
    from gpu_summary import write_summary  # beside this file

    device, tiny = args.device, args.device == "cpu"
    repeats = args.repeats or (1 if tiny else 3)
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work = out / "work"  # the steps' working folder: no vtoken/ in it
    work.mkdir(exist_ok=True)
    info = environment(device)
    print(f"run_gpu: {info.get('gpu', device)}; torch {info['torch']}, triton {info.get('triton')}, transformers "
          f"{info.get('transformers')}, vtoken from {info.get('vtoken_from')}", flush=True)  # fmt: skip
    deadline = time.monotonic() + (args.budget_s or (3600.0 if tiny else 480.0))
    done = []
    for step in STEPS:
        if args.steps and step.name not in args.steps:
            continue
        left = deadline - time.monotonic()
        if left < 10:
            done.append({"step": step.name, "status": "not run: the time budget was spent", "seconds": 0.0})
        else:
            timeout = min(step.timeout_s * (4 if tiny else 1), left)
            log = out / "logs" / f"{step.name}_{device}.log"
            done.append(run_step(step, step.argv(device, tiny, repeats, out), timeout, log, work))
        print(f"run_gpu: {done[-1]['step']}: {done[-1]['status']} ({done[-1]['seconds']} s)", flush=True)
        write_summary(out, device, info, done, tests=_test_counts(out), smoke=tiny)
        if args.archive:
            pack(out, device, args.archive)
    summary = write_summary(out, device, info, done, tests=_test_counts(out), smoke=tiny)
    print(summary["markdown"])
    if args.archive:
        pack(out, device, args.archive)
    failed = [d for d in done if d["status"] != "ok"]
    return 1 if failed else 0


def _test_counts(out: Path) -> dict | None:
    """passed / failed / skipped / errors of the CUDA tests (their JUnit report), or None before they ran."""
    report = out / "logs" / "tests.xml"
    if not report.exists():
        return None
    try:
        root = ElementTree.parse(report).getroot()
    except ElementTree.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    return {**total, "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failing": failing}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
