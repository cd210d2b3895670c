"""Which attention a sparse prefill layer runs: the break-even model (recorded GPU measurements) and the backend
choice for `backend="auto"`.

Break-even. A layer's sparse attention costs the estimate (vertical-slash plans only) plus the block-sparse kernel;
the model's own attention (SDPA, flash on a GPU) costs one dense causal pass. `BreakEven` predicts their ratio

    ratio(L, rho) = estimate(L) + fixed(L) + per_density(L) * rho        (sparse time / dense time, one layer)

from measurements at a few lengths L (interpolated linearly in log2 L, held beyond the longest); a layer runs
sparse only where the prediction is below `margin` (0.9: a predicted gain of at least 11 %), and below the
shortest measured length, where there is no evidence, it runs dense. The models are keyed by the GPU's name
(`torch.cuda.get_device_name`): `RECORDED` holds what was measured on named GPUs (`CUDA_H200`, provenance in its
`source`; no H100 entry until one is measured: another GPU's constants would be a guess), `MEASURED` what
`vtoken.warmup` measured in this process (`measure_break_even`), which wins. A GPU with neither runs where
`min_length` says, after one warning naming `vtoken.warmup`. `python benchmarks/bench_sparse_prefill.py --device
cuda` measures the same quantities and prints a `BreakEven(...)` to record. Off CUDA there is no model: the CPU
backends are for checking results, not speed, and `min_length` alone decides there.

Backend choice. On CUDA, `BackendChoice` times every available backend (the Triton kernel, FlexAttention) on the
first call of each shape class (device, dtype, batch, heads, head dim, plan block, length and density buckets,
padding, A-shape) and keeps the fastest for the rest of the process: measured where it runs, once, with one host
sync per class. On CPU nothing is measured: the PyTorch reference (dense underneath) while its [B, H, S, S] scores
stay small (`DENSE_SCORES_LIMIT`), FlexAttention (compiled by inductor's C++ backend, block-sparse) beyond that.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .block_sparse_flex import bucket, flex_unavailable

try:
    import triton
except ImportError:  # the `kernels` extra is optional
    triton = None

# B x H x S x S scores (fp32: 64 MiB) up to which the CPU reference runs. Beyond, compiled FlexAttention: in two
# runs of this project's CPU cut (28 heads, head dim 128, 1k tokens, a shared machine) it ran 3-14x faster than the
# reference (0.8-2.8x SDPA's speed), for a compilation of ~10-40 s once per length bucket, which small tests and
# tiny models never repay.
DENSE_SCORES_LIMIT = 1 << 24


@dataclass(frozen=True)
class BreakEven:
    """Predicted sparse / dense time of one attention layer (see the module docstring).

    lengths: measured prompt lengths (tokens, ascending); fixed, per_density: the kernel's time over dense attention
    as fixed + per_density * rho at each length; estimate: the vertical-slash estimate's time over dense attention
    at each length; margin: run sparse only below this predicted ratio; source: where the numbers come from."""

    lengths: tuple[int, ...]
    fixed: tuple[float, ...]
    per_density: tuple[float, ...]
    estimate: tuple[float, ...]
    margin: float = 0.9
    source: str = ""

    def __post_init__(self) -> None:
        sizes = {len(self.lengths), len(self.fixed), len(self.per_density), len(self.estimate)}
        if len(sizes) != 1 or not self.lengths or list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError("BreakEven: lengths ascending, one fixed / per_density / estimate value per length")
        if not 0 < self.margin <= 1:
            raise ValueError(f"BreakEven: margin={self.margin}; expected a ratio in (0, 1]")
        if min(self.per_density) < 0 or min(self.fixed) < 0 or min(self.estimate) < 0:
            raise ValueError("BreakEven: fixed, per_density and estimate are times over dense attention, >= 0")

    def _at(self, values: tuple[float, ...], length: int) -> float:
        if length >= self.lengths[-1]:
            return values[-1]
        i = next(i for i, known in enumerate(self.lengths) if known > length) - 1
        low, high = math.log2(self.lengths[i]), math.log2(self.lengths[i + 1])
        w = (math.log2(length) - low) / (high - low)
        return values[i] * (1 - w) + values[i + 1] * w

    def ratio(self, length: int, density: float, estimated: bool) -> float | None:
        """Predicted sparse / dense time of one layer at `length` tokens and plan density `density` (with the
        vertical-slash estimate when `estimated`); None below the shortest measured length (no evidence)."""
        if length < self.lengths[0]:
            return None
        kernel = self._at(self.fixed, length) + self._at(self.per_density, length) * density
        return kernel + (self._at(self.estimate, length) if estimated else 0.0)

    def density_limit(self, length: int, estimated: bool) -> float | None:
        """The largest plan density predicted to gain at `length` (0: none does; None: no evidence)."""
        if length < self.lengths[0]:
            return None
        fixed = self._at(self.fixed, length) + (self._at(self.estimate, length) if estimated else 0.0)
        slope = self._at(self.per_density, length)
        if slope == 0:
            return 1.0 if fixed < self.margin else 0.0
        return max(0.0, min(1.0, (self.margin - fixed) / slope))

    def decide(self, length: int, density: float, estimated: bool) -> tuple[bool, str]:
        """(run sparse?, why) for one layer."""
        ratio = self.ratio(length, density, estimated)
        if ratio is None:
            return False, f"no measurement below {self.lengths[0]} tokens: dense is the safe choice"
        verdict = f"predicted {ratio:.2f}x the dense layer's time at {length} tokens, density {density:.3f}"
        if ratio < self.margin:
            return True, verdict
        limit = self.density_limit(length, estimated)
        return False, f"{verdict} (break-even margin {self.margin}; gains below density {limit:.2f})"


# --------------------------------------------------------------------- the recorded measurement
# Issue 32's GPU run: NVIDIA H200, bf16, Qwen2.5-VL-7B's attention (28 query / 4 KV heads, head dim 128), plan block
# 64, vtoken's first Triton kernel (64-row tiles, no pipelining): speedup of the block-sparse kernel over SDPA
# (flash) at densities 1, 0.5, 0.2, 0.1, 0.05.
KERNEL_DENSITIES = (1.0, 0.5, 0.2, 0.1, 0.05)
KERNEL_SPEEDUPS = {
    8192: (0.59, 1.09, 2.20, 3.33, 4.29),
    32768: (0.53, 1.09, 2.54, 4.67, 7.92),
    65536: (0.50, 1.12, 2.73, 5.13, 9.72),
    131072: (0.60, 1.27, 3.13, 6.14, 11.8),
}
# The same run end to end (Qwen2.5-VL-7B shape, 28 layers, one video, vertical_slash at density 0.1): TTFT speedup
# over dense and, where printed, its share of the bound 1 / (1 - a + a * rho).
END_TO_END = {8192: (0.76, None), 32768: (1.14, 0.92), 65536: (1.30, 0.86)}
ACHIEVED_DENSITY = 0.11  # density 0.1 plus the sink and diagonal blocks every row keeps, at 32k-64k tokens


def fit_kernel(densities, speedups) -> tuple[float, float]:
    """(fixed, per_density) of time ratio = 1 / speedup ~ fixed + per_density * rho, least squares (the slope at
    least 0: noise must not make denser plans look cheaper), then `fixed` raised so that no measured point is
    slower than the fit predicts (conservative)."""
    ratios = [1 / s for s in speedups]
    n = len(densities)
    mean_x, mean_y = sum(densities) / n, sum(ratios) / n
    spread = sum((x - mean_x) ** 2 for x in densities)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(densities, ratios, strict=True))
    slope = max(covariance / spread, 0.0) if spread > 0 else 0.0
    fixed = mean_y - slope * mean_x
    fixed += max(0.0, *(y - (fixed + slope * x) for x, y in zip(densities, ratios, strict=True)))
    return fixed, slope


def estimate_share(length: int, kernel: tuple[float, float]) -> float:
    """The vertical-slash estimate's time over one dense attention layer, implied by the end-to-end run.

    TTFT ratio 1 / s = 1 - a + a * r, where a is the share of the dense prefill spent in attention and r the sparse
    layer's time over the dense one (estimate + kernel). Where the run printed its share of the bound
    B = 1 / (1 - a + a * rho): a = (1 - 1 / B) / (1 - rho). At 8k (no share printed) a scales from 32k and 64k as
    attention over the rest (a / (1 - a) proportional to L)."""
    kernel_ratio = kernel[0] + kernel[1] * ACHIEVED_DENSITY

    def share(at: int) -> float:
        speedup, of_bound = END_TO_END[at]
        return (1 - of_bound / speedup) / (1 - ACHIEVED_DENSITY)

    speedup, of_bound = END_TO_END[length]
    if of_bound is not None:
        a = share(length)
    else:
        odds = [share(at) / (1 - share(at)) / at for at, (_, shown) in END_TO_END.items() if shown is not None]
        a = sum(odds) / len(odds) * length / (1 + sum(odds) / len(odds) * length)
    return max(0.0, 1 + (1 / speedup - 1) / a - kernel_ratio)


def _recorded() -> BreakEven:
    lengths = tuple(KERNEL_SPEEDUPS)
    kernel = [fit_kernel(KERNEL_DENSITIES, KERNEL_SPEEDUPS[n]) for n in lengths]
    estimate = [estimate_share(n, fit) if n in END_TO_END else None for n, fit in zip(lengths, kernel, strict=True)]
    estimate = [e if e is not None else estimate[i - 1] for i, e in enumerate(estimate)]  # 128k: held from 64k
    return BreakEven(
        lengths=lengths,
        fixed=tuple(f for f, _ in kernel),
        per_density=tuple(p for _, p in kernel),
        estimate=tuple(estimate),
        margin=0.9,
        source="issue 32 / shared GPU.md: H200, bf16, 28/4 heads, head dim 128, block 64, first Triton kernel "
        "(kernel table fitted per length; estimate from the Qwen2.5-VL-7B end-to-end run, 2026-11-27)",
    )


CUDA_H200 = _recorded()
# a fragment of the GPU's name -> its measured model; an H100 entry is added once a run on one records it
RECORDED: dict[str, BreakEven] = {"H200": CUDA_H200}
MEASURED: dict[str, BreakEven] = {}  # GPU name -> the model `vtoken.warmup` measured in this process
_unmeasured_warned: set[str] = set()


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU's name for a CUDA device (once per device and process: a driver query, no sync); the device type
    elsewhere."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def recorded_break_even(device: torch.device | str) -> BreakEven | None:
    """The model for a device (a `torch.device`, or a GPU's name): measured in this process at warm-up, else
    recorded for its GPU name; None where neither (a CPU, an unmeasured GPU): `min_length` alone decides."""
    name = device if isinstance(device, str) else device_name(torch.device(device))
    if name in MEASURED:
        return MEASURED[name]
    return next((model for fragment, model in RECORDED.items() if fragment in name), None)


def warn_unmeasured(name: str) -> None:
    """One warning per GPU name: no speed model, so `min_length` decides where sparse attention runs."""
    if name in _unmeasured_warned:
        return
    _unmeasured_warned.add(name)
    warnings.warn(
        f"vtoken sparse_prefill: no break-even measurement for {name} (recorded: "
        f"{', '.join(RECORDED) or 'none'}): min_length alone decides where sparse attention runs, which may be "
        "slower than dense attention; call vtoken.warmup(model) once before serving to measure this GPU",
        UserWarning,
        stacklevel=4,
    )


def measure_break_even(
    run_dense: Callable[[int], Callable[[], object]],
    run_sparse: Callable[[int, float], Callable[[], object]],
    run_estimate: Callable[[int], Callable[[], object]] | None,
    lengths: Sequence[int],
    densities: Sequence[float] = KERNEL_DENSITIES,
    timer: Callable | None = None,
    repeats: int = 5,
    source: str = "",
) -> BreakEven:
    """A `BreakEven` from timings on this device: at each length, the dense layer (`run_dense(L)`), the sparse
    kernel at each density (`run_sparse(L, rho)`) and the vertical-slash estimate (`run_estimate(L)`; None: 0),
    each a prepared callable timed after one warm-up run; the kernel's ratios fitted as `fit_kernel` does."""
    timer = timer or _cuda_seconds

    def seconds(run: Callable[[], object]) -> float:
        run()  # compiles, autotunes
        times, _ = timer(run, repeats)
        return sorted(times)[len(times) // 2]

    lengths = sorted(set(lengths))
    fixed, slopes, estimates = [], [], []
    for length in lengths:
        dense = seconds(run_dense(length))
        speedups = [dense / seconds(run_sparse(length, rho)) for rho in densities]
        fit = fit_kernel(densities, speedups)
        fixed.append(fit[0])
        slopes.append(fit[1])
        estimates.append(seconds(run_estimate(length)) / dense if run_estimate is not None else 0.0)
    return BreakEven(lengths=tuple(lengths), fixed=tuple(fixed), per_density=tuple(slopes), estimate=tuple(estimates),
                     margin=0.9, source=source)  # fmt: skip


# --------------------------------------------------------------------- backend choice
def available_backends(device_type: str) -> list[str]:
    """The kernels that can run on `device_type` with what is installed ("torch" always can)."""
    names = []
    if device_type == "cuda" and triton is not None:
        names.append("triton")
    if flex_unavailable(device_type) is None:
        names.append("flex")
    return names + ["torch"]


def cpu_backend(batch: int, heads: int, seq: int) -> str:
    """backend="auto" off CUDA, without measuring: the reference while its dense scores stay small, else
    FlexAttention (block-sparse, O(S) memory per block) where this torch has it."""
    if batch * heads * seq * seq <= DENSE_SCORES_LIMIT or flex_unavailable("cpu") is not None:
        return "torch"
    return "flex"


def _density_bucket(density: float) -> float:
    return next(b for b in (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0) if density <= b + 1e-9)


def _cuda_seconds(run: Callable[[], torch.Tensor], repeats: int) -> tuple[list[float], torch.Tensor]:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    out = None
    for start, stop in events:
        start.record()
        out = run()
        stop.record()
    events[-1][1].synchronize()
    return [start.elapsed_time(stop) / 1e3 for start, stop in events], out


class BackendChoice:
    """backend="auto" on CUDA: the fastest backend per shape class, measured once per process (thread-safe).

    `timer(run, repeats) -> (seconds per run, last output)` is CUDA events by default; tests pass their own."""

    def __init__(self, timer: Callable | None = None, repeats: int = 3):
        self._timer = timer or _cuda_seconds
        self._repeats = repeats
        self._best: dict[tuple, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def shape_class(q: torch.Tensor, k: torch.Tensor, block: int, density: float, padded: bool, window: int) -> tuple:
        device = q.device
        name = device_name(device)
        batch, heads, seq, dim = q.shape
        return (str(device), name, q.dtype, batch, heads, k.shape[1], dim, block, 1 << (seq - 1).bit_length(),
                _density_bucket(density), padded, window > 0)  # fmt: skip

    def known(self, key: tuple) -> str | None:
        return self._best.get(key)

    def pick(self, key: tuple, runs: dict[str, Callable[[], torch.Tensor]]) -> tuple[str, torch.Tensor | None]:
        """(the fastest backend for `key`, its output if it was just measured on these inputs, else None)."""
        best = self._best.get(key)
        if best is not None:
            return best, None
        with self._lock:
            if key in self._best:
                return self._best[key], None
            outputs, medians, failed = {}, {}, {}
            for name, run in runs.items():  # warm-up: compiles (FlexAttention) and autotunes (Triton)
                try:
                    run()
                except Exception as error:  # a backend that cannot run here is left out, not fatal
                    failed[name] = error
            if len(failed) == len(runs):
                raise RuntimeError(f"no sparse attention backend runs here: {failed}") from next(iter(failed.values()))
            for name, error in failed.items():
                warnings.warn(f"vtoken sparse_prefill: backend {name!r} failed ({error}); auto uses the others",
                              UserWarning, stacklevel=3)  # fmt: skip
            for name, run in runs.items():
                if name not in failed:
                    seconds, outputs[name] = self._timer(run, self._repeats)
                    medians[name] = sorted(seconds)[len(seconds) // 2]
            best = min(medians, key=medians.get)
            self._best[key] = best
            return best, outputs[best]


BACKEND_CHOICE = BackendChoice()


def length_bucket(seq: int) -> int:
    """The length FlexAttention pads a prompt to (exported for the benchmark)."""
    return bucket(seq)
