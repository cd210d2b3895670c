"""Shared benchmark helpers: interleaved timing, peak memory, result files.

Every number a benchmark reports is measured in one process under `vtoken.timing`'s rule: configurations
interleaved repetition by repetition after a warm-up, so that machine drift hits all of them alike; tables report
the median and min-max of the runs, and a speedup whose spread contains 1.0 reads "within noise".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from vtoken.provenance import run_info
from vtoken.timing import Ratio, compare, device_sync, measure

RESULTS = Path(__file__).parent / "results"  # the tables the docs show: written only when --out names it
DEFAULT_OUT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vtoken" / "benchmarks"
# --tiny (a smoke run on a CPU, `run_gpu.py --device cpu`): the tiny models keep their own widths; of the real
# shapes' settings only these (depth and what follows it) are applied, so that every code path of the GPU run
# executes in seconds. It measures nothing.
TINY = False
TINY_KEYS = frozenset({"num_hidden_layers", "depth", "deepstack_visual_indexes", "fullatt_block_indexes"})


def add_tiny(parser: argparse.ArgumentParser) -> None:
    """`--tiny`: the smoke run (see `TINY`); with `--device cpu`, what `run_gpu.py --device cpu` runs."""
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: tiny widths (checks that the script runs; no numbers)")  # fmt: skip


def set_tiny(args) -> bool:
    """Switch the tiny widths on from parsed `--tiny` (module-wide: `shaped` reads it)."""
    global TINY
    TINY = bool(getattr(args, "tiny", False))
    return TINY


def shaped(overrides: dict) -> dict:
    """A model's real-shape settings, or under `--tiny` only their depth keys (`TINY_KEYS`)."""
    if not TINY:
        return overrides
    return {section: {key: value for key, value in values.items() if key in TINY_KEYS}
            for section, values in overrides.items()}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory above the level at entry, in bytes: CUDA allocator stats on GPU, sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self._rss())
            time.sleep(0.0005)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            try:  # hand freed arenas back to the OS so RSS starts from what is really in use
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            self._base = self._max = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, self._rss()) - self._base


def interleaved(
    configs: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    warmup: int = 1,
    contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
):
    """Run each config `warmup + repeats` times under `vtoken.timing`'s rule (interleaved, order rotated each
    repetition); name -> {median_s, times_s, timing (a `vtoken.timing.Timing`), peak_bytes}. `clock`: wall time,
    or e.g. `time.thread_time` (with one torch thread: the work done, on a shared CPU).

    contexts[name], if given, makes a context entered around each run of that config but outside the timer
    (e.g. patching the model); peak memory is measured inside it, also outside the timer.
    """
    contexts = contexts or {}
    peaks: dict[str, int] = dict.fromkeys(configs, 0)
    runs = dict.fromkeys(configs, 0)

    def around(name):
        @contextmanager
        def context():
            with contexts.get(name, nullcontext)(), PeakMemory(device) as mem:
                yield
            runs[name] += 1
            if runs[name] > warmup:
                peaks[name] = max(peaks[name], mem.peak)

        return context

    timed = measure(configs, repeats, warmup, around={name: around(name) for name in configs}, clock=clock,
                    sync=device_sync(device))  # fmt: skip
    return {
        name: {"median_s": t.median, "times_s": list(t.times), "timing": t, "peak_bytes": peaks[name]}
        for name, t in timed.items()
    }


def timing_row(base: dict, result: dict, oracle: dict | None = None) -> dict:
    """A results row's timing fields: TTFT median, min, max and runs; the speedup over `base` with its spread
    and verdict ('faster', 'slower', 'within noise'); with `oracle`, the same against the oracle's time."""
    t, r = result["timing"], speedup(base, result)
    row = {"ttft_ms": t.median * 1e3, "ttft_min_ms": t.low * 1e3, "ttft_max_ms": t.high * 1e3, "runs": t.n,
           "speedup": r.value, "speedup_low": r.low, "speedup_high": r.high, "speedup_verdict": r.verdict,
           "speedup_text": str(r)}  # fmt: skip
    if oracle is not None:
        o = speedup(oracle, result)  # > 1: faster than the oracle (< 1 is the expected overhead)
        row.update(vs_oracle=o.value, vs_oracle_low=o.low, vs_oracle_high=o.high, vs_oracle_text=str(o))
    return row


def ttft_cell(row: dict) -> str:
    """'median (min-max)' of a `timing_row`, in milliseconds."""
    if row["runs"] < 2:
        return f"{row['ttft_ms']:.1f}"
    return f"{row['ttft_ms']:.1f} ({row['ttft_min_ms']:.1f}-{row['ttft_max_ms']:.1f})"


def speedup(base: dict, result: dict) -> Ratio:
    """The speedup of `result` over `base` under the timing rule (its str says 'within noise' when the spreads
    cannot tell them apart)."""
    return compare(base["timing"], result["timing"])


def environment(device: torch.device) -> dict:
    """Versions, commit, device and date of this run (every results JSON records them)."""
    return run_info(device)


def add_out(parser: argparse.ArgumentParser) -> None:
    """`--out DIR`: where results go (default outside the repository, so `make bench` never overwrites the shipped
    tables in benchmarks/results/; pass `--out benchmarks/results` to update those on purpose)."""
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the JSON, Markdown and plots (default: {DEFAULT_OUT})")  # fmt: skip


def write_results(name: str, payload: dict, table: str, out: Path) -> tuple[Path, Path]:
    """`payload` as out/<name>.json (with this run's environment if it has none) and `table` as out/<name>.md."""
    out.mkdir(parents=True, exist_ok=True)
    payload = payload if "environment" in payload else {"environment": run_info("cpu"), **payload}
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(table + "\n")
    return json_path, md_path


def ttft_parser(doc: str, cpu_layers_help: str):
    """The options every TTFT benchmark takes: device, repeats, CPU depth, budgets."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--repeats",
        "--runs",
        type=int,
        default=None,
        help="timed runs per config, interleaved after a warm-up (default: 10 on cuda, 2 on cpu)",
    )
    parser.add_argument("--cpu-layers", type=int, default=1, help=cpu_layers_help)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1, 0.05])
    add_tiny(parser)
    return parser


def run_settings(args) -> tuple[torch.device, torch.dtype, int | None, int]:
    """(device, dtype, depth, repeats) from `ttft_parser` options: bf16 at full depth on a GPU, fp32 at
    `--cpu-layers` on a CPU."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    set_tiny(args)
    return (
        device,
        torch.bfloat16 if cuda else torch.float32,
        None if cuda else args.cpu_layers,
        args.repeats or (10 if cuda else 2),
    )


def ttft_table(title: str, rows: dict[str, dict]) -> list[str]:
    """Markdown lines for one model's rows of `bench_families.measure` (config -> measurements)."""
    lines = [
        "",
        title,
        "",
        "| config | visual tokens | TTFT ms (median, min-max) | speedup (spread) | vs oracle's TTFT | selection ms "
        "| selection / TTFT | selection / unpruned TTFT | peak MB |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        rel = row.get("vs_oracle_text", "")
        sel = f"{row['selection_ms']:.2f}" if "selection_ms" in row else ""
        share = f"{row['selection_ms'] / row['ttft_ms']:.1%}" if "selection_ms" in row else ""
        unpruned = f"{row['selection_share']:.1%}" if "selection_share" in row else ""
        speed = "(baseline)" if name == "unpatched" else row["speedup_text"]
        lines.append(
            f"| {name} | {row['visual_tokens']} | {ttft_cell(row)} | {speed} | {rel} | {sel} | {share} | {unpruned} | "
            f"{row['peak_mb']:.0f} |"
        )
    return lines


def report(name: str, device: torch.device, dtype: torch.dtype, repeats: int, results: dict, lines: list[str],
           out: Path):  # fmt: skip
    """Write `results` and the table `lines` (under a header naming the machine) to out/<name>_<device>."""
    env = environment(device)
    header = (
        f"Random weights, real shapes, {device.type} ({env.get('gpu', 'CPU')}), {dtype}, batch 1, median and "
        f"min-max of {repeats} interleaved runs after a warm-up; a speedup whose spread contains 1.0 is within noise."
    )
    table = "\n".join([header, *lines])
    payload = {"environment": env, "repeats": repeats, "results": results}
    json_path, md_path = write_results(f"{name}_{device.type}", payload, table, out)
    print(table)
    print(f"\nwrote {json_path} and {md_path}")
