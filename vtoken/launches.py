"""Count what a block of code would cost a GPU's host: the kernels it launches and the host-device syncs it forces.

On a GPU every launched kernel costs ~10-20 us of host time and every sync (`.item()`, `int(t)`, `.tolist()`,
`nonzero`, boolean-mask indexing, indexing with a 0-d tensor, `torch.tensor(list)` copied to the device) drains
the queue. A CPU run hides both behind the arithmetic, so vtoken's tests count them instead of timing them:

    with count_launches() as counted:
        method.select(tokens)
    assert counted.syncs == 0, counted.describe()

The count runs on any device (CPU tensors included) and reads ATen ops as a `TorchDispatchMode` sees them: a view
or an allocation launches nothing, every other op one kernel, and a custom op (`vtoken::*`, a Triton kernel on
CUDA) one launch, however much its CPU reference does inside. Syncs are the ops whose CUDA implementation waits for
the device (data-dependent output shapes, a scalar read back, a copy between host and device) plus the Python-level
reads that never reach ATen on a CPU tensor (`tolist`, `numpy`). On CUDA, `no_host_syncs` turns a sync into an
error (`torch.cuda.set_sync_debug_mode`), the check the counts stand in for.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ops that allocate or re-describe memory without a kernel
FREE_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "detach", "alias", "lift_fresh", "_local_scalar_dense",
     "resize_", "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "record_stream"}
)  # fmt: skip
# ops whose CUDA implementation waits for the device: an output shape read from the data, or a value read back
SYNC_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "argwhere", "masked_select", "is_nonzero", "equal", "bincount", "histc",
     "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
     "lift_fresh_copy", "_linalg_eigh", "linalg_eigh", "linalg_inv", "cholesky", "linalg_cholesky"}
)  # fmt: skip
# Python-level reads that copy a whole tensor to the host; on a CPU tensor they dispatch no ATen op
HOST_READS = frozenset({"tolist", "numpy", "__array__"})


@dataclass
class Launches:
    """What a counted block launched: `kernels` (device kernels, a custom op counting once), `syncs` (host-device
    synchronisations), `ops` (kernel count per ATen or custom op name) and `sync_sites` (per sync: what forced it and
    the innermost line of the caller's code, outside torch)."""

    kernels: int = 0
    syncs: int = 0
    ops: Counter = field(default_factory=Counter)
    sync_sites: list[str] = field(default_factory=list)

    def describe(self, top: int = 12) -> str:
        """A short report for assertion messages: totals, the commonest ops, and where the syncs came from."""
        common = ", ".join(f"{name} x{n}" for name, n in self.ops.most_common(top))
        sites = Counter(self.sync_sites)
        where = "; ".join(f"{site} x{n}" for site, n in sites.most_common(top))
        return f"{self.kernels} kernels ({common}); {self.syncs} syncs" + (f" ({where})" if where else "")


def _caller_site() -> str:
    """The innermost frame outside torch and this module: 'path:line (function)'."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir) and "contextlib" not in path:
            parts = path.split(os.sep)
            short = os.sep.join(parts[-3:])
            return f"{short}:{frame.lineno} ({frame.name})"
    return "?"


def _op_name(func) -> str:
    namespace = getattr(func, "namespace", "aten")
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)
    return name if namespace == "aten" else f"{namespace}::{name}"


def _is_bool_index(func, args) -> bool:
    """Indexing with a boolean mask (x[mask], x[mask] = v): its output size is the mask's count, read back."""
    if _op_name(func) not in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_host_data(name: str, args) -> bool:
    """`torch.tensor(data)`: a tensor made from host data, copied to the device when it is not a CPU tensor's (a
    0-d one travels as a kernel argument, as Python scalars do)."""
    return name == "lift_fresh" and isinstance(args[0], torch.Tensor) and args[0].dim() > 0


def _crosses_devices(func, args, kwargs) -> bool:
    """A copy between the host and a device (either way), which waits for the device's queue."""
    name = _op_name(func)
    if name == "_to_copy" and "device" in kwargs and isinstance(args[0], torch.Tensor):
        return torch.device(kwargs["device"]).type != args[0].device.type
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].device.type != args[1].device.type
    return False


def _forces_sync(func, name: str, args, kwargs) -> bool:
    if name in SYNC_OPS or _is_host_data(name, args) or _is_bool_index(func, args):
        return True
    if func is torch.ops.aten.repeat_interleave.Tensor:  # its output size is the repeats' sum, unless given
        return kwargs.get("output_size") is None
    return _crosses_devices(func, args, kwargs)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, launches: Launches, sites: bool) -> None:
        super().__init__()
        self.launches, self.sites, self.quiet = launches, sites, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.quiet:
            name = _op_name(func)
            view = getattr(func, "is_view", False)
            if not view and name not in FREE_OPS:
                self.launches.kernels += 1
                self.launches.ops[name] += 1
            if _forces_sync(func, name, args, kwargs):
                self.launches.syncs += 1
                self.launches.sync_sites.append(f"{name} at {_caller_site()}" if self.sites else name)
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    """Sees `tolist`/`numpy`, which read a CPU tensor without any ATen op; what they dispatch is not counted again."""

    def __init__(self, dispatch: _DispatchCounter) -> None:
        super().__init__()
        self.dispatch = dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in HOST_READS or self.dispatch.quiet:
            return func(*args, **kwargs)
        launches = self.dispatch.launches
        launches.syncs += 1
        launches.sync_sites.append(f"{name} at {_caller_site()}" if self.dispatch.sites else name)
        self.dispatch.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.dispatch.quiet -= 1


@contextlib.contextmanager
def count_launches(sites: bool = True) -> Iterator[Launches]:
    """Count the kernels and host syncs of the block (see the module's docstring); `sites`: record where each sync
    came from (slower: a stack walk per sync)."""
    launches = Launches()
    dispatch = _DispatchCounter(launches, sites)
    with _FunctionCounter(dispatch), dispatch:
        yield launches


@contextlib.contextmanager
def no_host_syncs(device: torch.device | str | None = None) -> Iterator[None]:
    """On CUDA, make any host-device sync inside the block an error (`torch.cuda.set_sync_debug_mode("error")`);
    elsewhere a no-op (use `count_launches` there)."""
    if device is not None and torch.device(device).type != "cuda" or not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
