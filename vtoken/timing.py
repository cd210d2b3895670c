"""A stopwatch that never stalls the GPU: CUDA events on CUDA (read lazily), perf_counter elsewhere."""

from __future__ import annotations

import statistics
import time

import torch


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
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        if self.cuda:
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


def time_to_first_token(model, inputs, repeats: int) -> float:
    """Median seconds of a one-token generate (image encoding + selection + prefill)."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
