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
reads that never reach ATen on a CPU tensor (`tolist`, `numpy`).

What CUDA pays for host data is counted as a CPU run cannot see it: a tensor made from host data on a named device
(`torch.tensor(x, device=d)`, `torch.as_tensor(x, device=d)`, 0-d included: a blocking copy from pageable memory)
and a blocking `.to(device)` / `.cuda()` / `copy_` of host data made in the block (`torch.tensor`, `.cpu()`,
`torch.from_numpy`) count as syncs, whatever the device is in the test; a non-blocking copy does not (from pinned
memory it waits for nothing, from pageable memory it is staged without waiting for the queue).

Work that is not a kernel but costs a request far more is counted apart (`Launches.events`) and reported: a CUDA
graph captured, a Triton kernel autotuned or compiled, a graph compiled by `torch.compile`. Inside a patched call
after warm-up each must be 0. `count_launches` sees the first three; dynamo compiles nothing under its dispatch
mode (the compiled code runs eagerly there), so `count_events`, which installs no mode, is the one to see all four.

On CUDA, `no_host_syncs` turns a sync into an error (`torch.cuda.set_sync_debug_mode("error")`), the check the
counts stand in for, and `cuda_sync_sites` lists where each real sync of a block came from.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
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
# tensors made from host data (Python numbers or lists, numpy arrays); with a device named, a blocking copy
FROM_HOST_DATA = frozenset({"tensor", "as_tensor", "from_numpy"})
# copies to a device; blocking unless non_blocking=True
TO_DEVICE = frozenset({"to", "cuda", "copy_"})
# what `Launches.events` counts (the names it reports)
CAPTURE, AUTOTUNE, TRITON_COMPILE, TORCH_COMPILE = (
    "cuda graph capture",
    "triton autotune",
    "triton compile",
    ("torch.compile"),
)


@dataclass
class Launches:
    """What a counted block launched: `kernels` (device kernels, a custom op counting once), `syncs` (host-device
    synchronisations), `ops` (kernel count per ATen or custom op name) and `sync_sites` (per sync: what forced it and
    the innermost line of the caller's code, outside torch)."""

    kernels: int = 0
    syncs: int = 0
    ops: Counter = field(default_factory=Counter)
    sync_sites: list[str] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    event_sites: list[str] = field(default_factory=list)

    @property
    def captures(self) -> int:
        """CUDA graphs captured in the block."""
        return self.events[CAPTURE]

    @property
    def autotunes(self) -> int:
        """Triton autotuner runs that benchmarked configurations in the block."""
        return self.events[AUTOTUNE]

    @property
    def compiles(self) -> int:
        """Triton kernels compiled and graphs compiled by `torch.compile` in the block."""
        return self.events[TRITON_COMPILE] + self.events[TORCH_COMPILE]

    def describe(self, top: int = 12) -> str:
        """A short report for assertion messages: totals, the commonest ops, where the syncs came from, and any
        capture, autotuning or compilation."""
        common = ", ".join(f"{name} x{n}" for name, n in self.ops.most_common(top))
        sites = Counter(self.sync_sites)
        where = "; ".join(f"{site} x{n}" for site, n in sites.most_common(top))
        text = f"{self.kernels} kernels ({common}); {self.syncs} syncs" + (f" ({where})" if where else "")
        if self.events:
            done = ", ".join(f"{name} x{n}" for name, n in self.events.items())
            text += f"; also {done} ({'; '.join(self.event_sites[:top])})"
        return text


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are never a caller's site: torch's, triton's (where installed)."""
    dirs = [os.path.dirname(os.path.abspath(torch.__file__))]
    try:
        import triton

        dirs.append(os.path.dirname(os.path.abspath(triton.__file__)))
    except ImportError:
        pass
    return tuple(dirs)


def _caller_site() -> str:
    """The innermost frame outside torch, triton, the warnings machinery and this module: 'path:line (function)'."""
    here = os.path.abspath(__file__)
    libraries = _library_dirs()
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        name = os.path.basename(path)
        if path != here and not path.startswith(libraries) and name not in ("contextlib.py", "warnings.py"):
            package = os.path.dirname(here)  # vtoken's own files by their path in the package, others' shortened
            if path.startswith(package + os.sep):
                short = os.path.relpath(path, os.path.dirname(package))
            else:
                short = os.sep.join(path.split(os.sep)[-3:])
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


def _target_device(name: str, args, kwargs) -> tuple[torch.device | None, bool]:
    """(the device a `to` / `cuda` / `copy_` call copies to, None where it names none; whether it is non-blocking)."""
    if name == "copy_":
        blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
        return args[0].device, not blocking
    if name == "cuda":
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        target = torch.device("cuda" if target is None else target if not isinstance(target, int) else f"cuda:{target}")
        return target, bool(kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
    target = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking"))
    for arg in args[1:]:
        if isinstance(arg, bool):
            non_blocking = non_blocking or arg
        elif isinstance(arg, (str, torch.device)):
            target = arg
        elif isinstance(arg, torch.Tensor):
            target = arg.device
        elif isinstance(arg, int):  # an index: a CUDA device
            target = f"cuda:{arg}"
    return (None if target is None else torch.device(target)), non_blocking


class _FunctionCounter(TorchFunctionMode):
    """Sees what never reaches ATen on a CPU tensor: `tolist`/`numpy`/`cpu` reads, tensors made from host data on a
    named device, and blocking copies of host data made in the block (tracked by identity, weakly); what they
    dispatch is not counted again as a sync."""

    def __init__(self, dispatch: _DispatchCounter) -> None:
        super().__init__()
        self.dispatch = dispatch
        self.host: dict[int, weakref.ref] = {}  # id -> tensor made from host data in the block, not yet counted

    def _is_host(self, tensor: object) -> bool:
        ref = self.host.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def _mark_host(self, tensor: object) -> None:
        if isinstance(tensor, torch.Tensor):
            key = id(tensor)
            self.host[key] = weakref.ref(tensor, lambda _, key=key: self.host.pop(key, None))

    def _sync(self, name: str) -> None:
        launches = self.dispatch.launches
        launches.syncs += 1
        launches.sync_sites.append(f"{name} at {_caller_site()}" if self.dispatch.sites else name)

    def _quietly(self, func, args, kwargs):
        self.dispatch.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.dispatch.quiet -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.dispatch.quiet:
            return func(*args, **kwargs)
        if name in HOST_READS:
            if not (args and self._is_host(args[0])):  # a copy already on the host (`.cpu()`) reads for free
                self._sync(name)
            return self._quietly(func, args, kwargs)
        if name == "cpu" and args and isinstance(args[0], torch.Tensor):
            source = args[0]
            if source.device.type == "cpu" and not self._is_host(source):  # a device read (dispatch sees none here)
                self._sync("cpu (a copy to the host)")
            out = func(*args, **kwargs)
            self._mark_host(out)
            return out
        if name in FROM_HOST_DATA:
            device = kwargs.get("device")
            out = self._quietly(func, args, kwargs)
            if device is not None or out.dim() > 0:  # copied to a named device, or a table destined for one
                self._sync(f"{name} from host data" + (" on a device" if device is not None else ""))
            else:
                self._mark_host(out)  # a host scalar: its copy to a device is the sync
            return out
        if name in TO_DEVICE and args and isinstance(args[0], torch.Tensor):
            source = args[1] if name == "copy_" and len(args) > 1 else args[0]
            if self._is_host(source):
                target, non_blocking = _target_device(name, args, kwargs)
                # a copy between device types is counted by the dispatch counter (`_crosses_devices`)
                if target is not None and not non_blocking and target.type == source.device.type:
                    self._sync(f"{name} of host data")
        return func(*args, **kwargs)


# --------------------------------------------------------------------- work that is not a kernel: events
_active: list[Launches] = []  # every counter open now (nested ones too): each event counts in all of them
_hooks_lock = threading.Lock()
_restore: list[Callable[[], None]] = []


def _event(name: str) -> None:
    site = f"{name} at {_caller_site()}"
    for launches in list(_active):
        launches.events[name] += 1
        launches.event_sites.append(site)


def _wrap(owner: object, attribute: str, make: Callable[[Callable], Callable]) -> None:
    """Replace owner.attribute by make(original) until the last counter closes."""
    original = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    if original is None:
        return
    setattr(owner, attribute, make(original))
    _restore.append(lambda: setattr(owner, attribute, original))


def _install_event_hooks() -> None:
    """Wrap what announces a capture, an autotuning run or a compilation (class attributes, restored on close)."""
    cuda_graph = getattr(torch.cuda, "CUDAGraph", None)
    if cuda_graph is not None:

        def capture(original):
            def capture_begin(self, *args, **kwargs):
                _event(CAPTURE)
                return original(self, *args, **kwargs)

            return capture_begin

        _wrap(cuda_graph, "capture_begin", capture)
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:  # the `kernels` extra is optional
        return
    benched = threading.local()

    def bench(original):
        def _bench(self, *args, **kwargs):
            benched.ran = True
            return original(self, *args, **kwargs)

        return _bench

    def run(original):
        def tuned_run(self, *args, **kwargs):
            outer, benched.ran = getattr(benched, "ran", False), False
            try:
                return original(self, *args, **kwargs)
            finally:
                if benched.ran:
                    _event(AUTOTUNE)
                benched.ran = outer

        return tuned_run

    def compile_(original):
        def _do_compile(self, *args, **kwargs):
            _event(TRITON_COMPILE)
            return original(self, *args, **kwargs)

        return _do_compile

    _wrap(Autotuner, "_bench", bench)
    _wrap(Autotuner, "run", run)
    _wrap(JITFunction, "_do_compile", compile_)


def _dynamo_graphs() -> int:
    """Graphs `torch.compile` has compiled in this process (dynamo's own counter; 0 before dynamo is imported)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo is None else dynamo.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def _counting_events(launches: Launches) -> Iterator[None]:
    with _hooks_lock:
        if not _active:
            _install_event_hooks()
        _active.append(launches)
    graphs = _dynamo_graphs()
    try:
        yield
    finally:
        compiled = _dynamo_graphs() - graphs
        if compiled:
            launches.events[TORCH_COMPILE] += compiled
            launches.event_sites.append(f"{TORCH_COMPILE} x{compiled} (graphs compiled by dynamo in the block)")
        with _hooks_lock:
            del _active[next(i for i, open_ in enumerate(_active) if open_ is launches)]
            if not _active:
                while _restore:
                    _restore.pop()()


@contextlib.contextmanager
def count_launches(sites: bool = True) -> Iterator[Launches]:
    """Count the kernels, host syncs and events (captures, autotuning, compilation) of the block (see the module's
    docstring); `sites`: record where each sync came from (slower: a stack walk per sync)."""
    launches = Launches()
    dispatch = _DispatchCounter(launches, sites)
    with _counting_events(launches), _FunctionCounter(dispatch), dispatch:
        yield launches


@contextlib.contextmanager
def count_events() -> Iterator[Launches]:
    """Count only the events of the block (CUDA graph captures, Triton autotuning and compilation, graphs compiled
    by `torch.compile`), without `count_launches`'s modes: dynamo does not compile under a Python dispatch mode (it
    runs the code eagerly), so a first-call compilation shows here, not there. `kernels` and `syncs` stay 0."""
    launches = Launches()
    with _counting_events(launches):
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


@contextlib.contextmanager
def cuda_sync_sites() -> Iterator[list[str]]:
    """On CUDA, every synchronising CUDA operation of the block as it really happens (sync debug mode "warn"),
    listed by where it came from: the innermost frame outside torch and this module, as `count_launches` names its
    sync sites. A method's documented reads are then allowed by name and count where "error" would stop at the
    first one. Off CUDA: an empty list (use `count_launches`)."""
    sites: list[str] = []
    if not torch.cuda.is_available():
        yield sites
        return
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites.append(_caller_site())  # the stack of the op that synchronised: this runs inside its call
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            warnings.showwarning = shown
