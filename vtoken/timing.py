"""Timing: the one rule every speed number vtoken prints follows (CLI, demo, `vtoken eval`, benchmarks).

1. Settings are **interleaved**: repetition r runs every setting once (in an order rotated by r), so drift of
   the machine (clock boost, other processes, thermal state) hits all of them alike.
2. **Warm-up** runs come first and are not counted.
3. Each setting reports the **median of N** runs and their **spread** (min-max).
4. A ratio (a speedup) is the ratio of medians with the spread it could have: [min A / max B, max A / min B].
   When that interval contains 1.0 the ratio is reported as **within noise**, never as a speedup or a slowdown;
   with a single run there is no spread and no claim.

`measure` runs the settings; `Timing` holds one setting's runs; `compare` makes the ratio; `Stopwatch` times
selection inside a forward without stalling the GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `vtoken --help` imports this module and stays light
    import torch

DEFAULT_REPEATS = 5  # timed runs per setting where a command does not say
DEFAULT_WARMUP = 1


class Stopwatch:
    """`start()` / `stop()` around work on `device`; `seconds` resolves once the work has finished.

    On CUDA the events are only synchronised when `seconds` is read (after the call returns), so timing the
    selection inside a forward adds no host-device synchronisation.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._stop = None
        self._seconds: float | None = None

    def start(self) -> Stopwatch:
        if self.cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        if self.cuda:
            import torch

            self._stop = torch.cuda.Event(enable_timing=True)
            self._stop.record()
        else:
            self._seconds = time.perf_counter() - self._start
        return self

    @property
    def seconds(self) -> float:
        if self._seconds is None:
            self._stop.synchronize()
            self._seconds = self._start.elapsed_time(self._stop) / 1e3
        return self._seconds


@dataclass(frozen=True)
class Timing:
    """The timed runs of one setting, in seconds (warm-up runs excluded)."""

    times: tuple[float, ...]

    def __post_init__(self):
        if not self.times:
            raise ValueError("a Timing needs at least one timed run")
        if any(not t >= 0 for t in self.times):  # also rejects NaN
            raise ValueError(f"run times must be >= 0 seconds; got {self.times}")

    @property
    def n(self) -> int:
        return len(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def low(self) -> float:
        return min(self.times)

    @property
    def high(self) -> float:
        return max(self.times)

    def ms(self) -> str:
        """'12.3 ms (11.9-13.0, n=5)': the median and the min-max of the runs, in milliseconds."""
        if self.n == 1:
            return f"{self.median * 1e3:.1f} ms (n=1)"
        return f"{self.median * 1e3:.1f} ms ({self.low * 1e3:.1f}-{self.high * 1e3:.1f}, n={self.n})"

    def to_dict(self) -> dict:
        """For results JSON: median, min, max and every run, in milliseconds."""
        ms = [t * 1e3 for t in self.times]
        return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": self.n, "runs_ms": ms}


@dataclass(frozen=True)
class Ratio:
    """`base` time / `other` time (> 1: `other` is faster), with the interval the spreads allow."""

    value: float
    low: float
    high: float
    n: int  # the smaller number of runs behind it

    @property
    def within_noise(self) -> bool:
        """True when the runs cannot tell the two apart: the interval contains 1.0, or there is no spread."""
        return self.n < 2 or self.low <= 1.0 <= self.high

    @property
    def verdict(self) -> str:
        """'faster', 'slower' or 'within noise'."""
        if self.within_noise:
            return "within noise"
        return "faster" if self.value > 1.0 else "slower"

    def __str__(self) -> str:
        """'2.04x faster (1.85-2.20)', '0.98x, within noise (0.91-1.07)' or '1.30x from one run: no spread'."""
        if self.n < 2:
            return f"{self.value:.2f}x from one run each: no spread, within noise"
        spread = f"({self.low:.2f}-{self.high:.2f})"
        if self.within_noise:
            return f"{self.value:.2f}x, within noise {spread}"
        return f"{self.value:.2f}x {self.verdict} {spread}"

    def to_dict(self) -> dict:
        return {"ratio": self.value, "low": self.low, "high": self.high, "verdict": self.verdict}


def compare(base: Timing, other: Timing) -> Ratio:
    """The speedup of `other` over `base` (median / median) and its spread [min base / max other,
    max base / min other]: an interval every pair of runs could have produced."""
    if other.median == 0 or other.low == 0:
        raise ValueError("cannot compare against a setting timed at 0 seconds")
    return Ratio(
        value=base.median / other.median,
        low=base.low / other.high,
        high=base.high / other.low,
        n=min(base.n, other.n),
    )


def measure(
    settings: dict[str, Callable[[], object]],
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    around: dict[str, Callable[[], AbstractContextManager]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time every setting `warmup + repeats` times, interleaved; name -> its `Timing` of the `repeats` runs.

    Repetition r runs the settings in their order rotated by r (so none always runs first). around[name], if
    given, makes a context entered around each run of that setting but outside the timer (e.g. patching the
    model). `sync` is called before reading the clock (e.g. `torch.cuda.synchronize`); `clock` is injectable
    for tests.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}; expected repeats >= 1 and warmup >= 0")
    around = around or {}
    names = list(settings)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + repeats):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            with around.get(name, nullcontext)():
                if sync is not None:
                    sync()
                start = clock()
                settings[name]()
                if sync is not None:
                    sync()
                elapsed = clock() - start
            if rep >= warmup:
                times[name].append(elapsed)
    return {name: Timing(tuple(t)) for name, t in times.items()}


def device_sync(device: torch.device | str | None) -> Callable[[], None] | None:
    """The `sync` for `measure` on `device`: CUDA synchronisation there, nothing elsewhere."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def time_to_first_token(
    model,
    inputs,
    settings: dict[str, Callable[[], AbstractContextManager]],
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
) -> dict[str, Timing]:
    """Time to first token (a one-token greedy `generate`: image encoding, selection, prefill) of `model` on
    `inputs` under each setting, interleaved: settings[name]() makes the context the model runs in (e.g.
    `lambda: vtoken.patched(model, ...)`; `nullcontext` for the unpatched model)."""

    def first_token():
        model.generate(**inputs, max_new_tokens=1, do_sample=False)

    return measure(
        dict.fromkeys(settings, first_token), repeats, warmup, around=settings, sync=device_sync(model.device)
    )


def summary(timings: dict[str, Timing], base: str) -> list[str]:
    """One line per setting: its time, and (settings other than `base`) its ratio to `base` under the rule."""
    width = max(len(name) for name in timings)
    lines = []
    for name, timing in timings.items():
        line = f"{name:<{width}}  {timing.ms()}"
        if name != base:
            line += f"  {compare(timings[base], timing)}"
        lines.append(line)
    return lines
