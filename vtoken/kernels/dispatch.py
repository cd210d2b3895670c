"""How a `vtoken::*` custom op gets its CUDA implementation, and what happens on CUDA without triton.

Every custom op's CPU implementation is its PyTorch reference; `register_cuda` gives it the Triton launcher on
CUDA. Where triton is not installed (the `kernels` extra) nothing is silent:

- a reference made of device work (tensor ops, maybe a fixed loop of them) runs on the GPU after one warning per
  process naming `pip install "vtoken[kernels]"` (slower: many small launches instead of one);
- a reference that reads the device back and loops on the host over its data (`.tolist()` of counts, a dynamic
  programme in Python) raises `VTokenError` instead: on a GPU it would cost a host sync per item or step.

`CUDA_KERNELS` keeps each op's CUDA implementation (the Python function the dispatcher calls) by name, so tests can
run it with its kernel launches stubbed (on `meta` tensors, where any host read fails): its launch parameters must
come from shapes.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import VTokenError

try:
    import triton
except ImportError:  # the `kernels` extra is optional
    triton = None

INSTALL = 'pip install "vtoken[kernels]"'
CUDA_KERNELS: dict[str, Callable[..., Any]] = {}  # "vtoken::name" -> what runs for CUDA tensors
_warned = False
_lock = threading.Lock()


class KernelsMissingWarning(UserWarning):
    """vtoken's custom ops run their PyTorch references on a CUDA GPU: triton is not installed."""


def warn_missing(op: str) -> None:
    """The one warning per process that CUDA work runs PyTorch references because triton is missing."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"vtoken: triton is not installed, so {op} and vtoken's other kernels run their PyTorch references on the "
        f"GPU (many small launches instead of one kernel each: slower selections); install the kernels with "
        f"{INSTALL}",
        KernelsMissingWarning,
        stacklevel=3,
    )


def register_cuda(op: Any, kernel: Callable[..., Any], reference: Callable[..., Any], host_loop: bool = False) -> None:
    """Register `op`'s (a `torch.library.custom_op`) CUDA implementation: `kernel` (the Triton launcher, same
    signature) where triton imports; without triton, `reference` after `warn_missing`, or, with `host_loop`
    (a reference that reads the device back and loops on the host), a `VTokenError` naming the install."""
    name = op._qualname
    if triton is not None:
        implementation = kernel
    elif host_loop:

        def implementation(*args: Any, **kwargs: Any) -> Any:
            raise VTokenError(
                f"{name} on a CUDA tensor needs triton: without it the PyTorch reference would read the GPU back and "
                f"loop on the host (a sync per item or step); install it with {INSTALL}, or run on the CPU"
            )

    else:

        def implementation(*args: Any, **kwargs: Any) -> Any:
            warn_missing(name)
            return reference(*args, **kwargs)

    CUDA_KERNELS[name] = implementation
    op.register_kernel("cuda")(implementation)
