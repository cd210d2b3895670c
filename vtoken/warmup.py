"""`vtoken.warmup(model, ...)`: what a patched model would otherwise pay in its first request, paid before it.

Call it once after `vtoken.patch`, before serving:

    vtoken.patch(model, vtoken.SparsePrefill())
    report = vtoken.warmup(model, inputs=processor(images=img, text=prompt, return_tensors="pt").to("cuda"),
                           lengths=[32768, 65536])
    print(report)

- Sparse prefill on a CUDA GPU whose name has no recorded break-even model (`vtoken.kernels.sparse_speed`): its
  model is measured here (SDPA against the sparse kernel at the LLM's attention shape, a few seconds) and used by
  every sparse stage of the process; without it such a GPU runs wherever `min_length` says, after a warning.
- Sparse prefill at every prompt length (`lengths`) and batch size (`batches`) to serve: one layer's attention on
  random inputs, padded rows and not, so that FlexAttention compiles its length bucket, Triton autotunes its
  kernel and `backend="auto"` measures its backends here, not inside a request.
- `inputs` (a typical request, on the model's device): one `generate` of `max_new_tokens` tokens, so that every
  other first-call cost of the patched model (Triton kernels compiled for the encoder methods, CUDA graphs
  captured) is paid here too.

The report says what was measured and prepared, and counts what the warm-up compiled, autotuned and captured
(`vtoken.launches.count_events`); a request after it should count none of them.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .api import handle_of
from .errors import VTokenError
from .launches import Launches, count_events

MEASURE_LENGTHS = (8192, 16384, 32768, 65536)  # where an unknown GPU's break-even is measured by default


@dataclass
class WarmupReport:
    """What `warmup` did: `measured` (GPU name -> the `BreakEven` measured there), `prepared` (one line per sparse
    prompt shape: what runs there and why), `generated` (whether `inputs` ran through `generate`) and `events`
    (compilations, autotuning runs and CUDA-graph captures it paid for)."""

    measured: dict[str, Any] = field(default_factory=dict)
    prepared: list[str] = field(default_factory=list)
    generated: bool = False
    events: Launches = field(default_factory=Launches)

    def __str__(self) -> str:
        lines = [f"break-even measured on {name}: {model}" for name, model in self.measured.items()]
        lines += [f"sparse prefill, {line}" for line in self.prepared]
        lines.append("one generate on the given inputs" if self.generated else "no inputs given: no generate")
        done = ", ".join(f"{name} x{n}" for name, n in self.events.events.items()) or "nothing compiled or tuned"
        return "\n".join([*lines, f"paid here: {done}"])


def _sizes(name: str, values: Any) -> list[int]:
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    try:
        sizes = list(values)
    except TypeError:
        sizes = None
    if not sizes or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        raise VTokenError(f"warmup: {name}={values!r}; expected a positive int or a non-empty list of them")
    return sorted(set(sizes))


def warmup(
    model: nn.Module,
    inputs: dict[str, Any] | None = None,
    *,
    lengths: int | list[int] | None = None,
    batches: int | list[int] = 1,
    measure: bool | str = "auto",
    max_new_tokens: int = 2,
) -> WarmupReport:
    """Pay a patched model's first-call costs now, outside any request (see the module docstring).

    model: a model patched with `vtoken.patch`. inputs: a typical request's processor outputs (None: no generate).
    lengths: prompt lengths in tokens the sparse prefill should be ready for (default: its `min_length`; the
    lengths of `MEASURE_LENGTHS` at or above it are measured for the break-even). batches: batch sizes to serve.
    measure: "auto" (measure the break-even only on a CUDA GPU without a recorded or measured one), True (measure
    it on CUDA even so) or False (never). max_new_tokens: the tokens `inputs` generate.
    """
    from .adapters.sparse_prefill import sparse_stages
    from .kernels.sparse_speed import MEASURED, device_name, recorded_break_even

    if not isinstance(model, nn.Module):
        raise VTokenError(f"warmup: model={type(model).__name__}; expected a model patched with vtoken.patch")
    handle = handle_of(model)
    if handle is None:
        raise VTokenError(f"warmup: this {type(model).__name__} is not patched by vtoken; call vtoken.patch first")
    if measure not in (True, False, "auto"):
        raise VTokenError(f"warmup: measure={measure!r}; expected 'auto', True or False")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise VTokenError(f"warmup: max_new_tokens={max_new_tokens!r}; expected an int >= 1")
    batches = _sizes("batches", batches)
    report = WarmupReport()
    with count_events() as events, torch.no_grad():  # generate's mode: a compiled kernel guards on it
        for stage in sparse_stages(model):
            method = stage.method
            sizes = _sizes("lengths", lengths if lengths is not None else method.min_length)
            device = next(stage.lm.parameters()).device
            if device.type == "cuda" and method.break_even is True and measure is not False:
                name = device_name(device)
                if measure is True or recorded_break_even(device) is None:
                    measured = [n for n in MEASURE_LENGTHS if n >= min(method.min_length, MEASURE_LENGTHS[-1])]
                    MEASURED[name] = report.measured[name] = stage.measure_break_even(measured)
            report.prepared += stage.warm(sizes, batches)
        if inputs is not None:
            model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
            report.generated = True
    report.events = events
    return report


class _CallableModule(types.ModuleType):
    """This module calls `warmup`: importing `vtoken.warmup` binds the package's `warmup` to the module (the import
    system does), where `vtoken.warmup(model)` must still be the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> WarmupReport:
        return warmup(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
