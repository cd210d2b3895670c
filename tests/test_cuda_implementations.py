"""Every `vtoken::*` custom op's CUDA implementation reads nothing back from the device, by construction: it runs
here on `meta` tensors at model shapes (where any read of data, `.item()`, `.tolist()`, `int(t)`, fails) with its
Triton launches stubbed, under the launch counter; its launch grids and launch parameters must be Python numbers
computed from shapes. Without triton, a CUDA tensor gets one clear warning naming the install, or a `VTokenError`
where the reference would loop on the host (the dispatch itself is exercised here on a test op)."""

from __future__ import annotations

import warnings

import pytest
import torch

import vtoken.kernels  # noqa: F401  (registers every op)
from vtoken.errors import VTokenError
from vtoken.kernels import dispatch
from vtoken.launches import count_launches

triton = pytest.importorskip("triton")
from triton.runtime.jit import KernelInterface  # noqa: E402

META = torch.device("meta")
SCALARS = (int, float, bool, str, type(None), torch.dtype)


def _t(*shape, dtype=torch.float32):
    return torch.empty(*shape, device=META, dtype=dtype)


# op -> (args at a model's shape, keyword args); several cases where an optional input changes the launch
CASES = {
    "attention_column_mean": [
        ((_t(2, 1024, 16, 80, dtype=torch.bfloat16), _t(2, 1024, 16, 80, dtype=torch.bfloat16), 80**-0.5), {})
    ],  # fmt: skip
    "attention_row_probs": [
        ((_t(5, 16, 64, dtype=torch.bfloat16), _t(5, 577, 16, 64, dtype=torch.bfloat16), 0.125), {}),
        ((_t(5, 16, 64), _t(5, 577, 16, 64), 0.125, _t(5, 577, dtype=torch.bool)), {}),
    ],
    "block_sparse_attention": [
        (
            (
                _t(1, 28, 8192, 128, dtype=torch.bfloat16),
                _t(1, 4, 8192, 128, dtype=torch.bfloat16),
                _t(1, 4, 8192, 128, dtype=torch.bfloat16),
                _t(1, 28, 128, dtype=torch.int32),
                _t(1, 28, 128, 16, dtype=torch.int32),
                64,
                128**-0.5,
            ),
            {},
        ),
        (
            (
                _t(2, 28, 4096, 128, dtype=torch.bfloat16),
                _t(2, 4, 4096, 128, dtype=torch.bfloat16),
                _t(2, 4, 4096, 128, dtype=torch.bfloat16),
                _t(2, 28, 32, dtype=torch.int32),
                _t(2, 28, 32, 8, dtype=torch.int32),
                128,
                128**-0.5,
                _t(2, 4096, dtype=torch.bool),
                64,
                1024,
            ),
            {},
        ),
    ],  # fmt: skip
    "greedy_max_coverage": [((_t(5, 588, 576), _t(5, 576, dtype=torch.bool), _t(5, dtype=torch.int64), 144), {})],
    "greedy_weighted_coverage": [
        ((_t(5, 588, 576), weight, _t(5, 576, dtype=torch.bool), _t(5, dtype=torch.int64), 144), {})
        for weight in (_t(5, 576), None)  # SCOPE's saliency weights; None: MMTok's unweighted gains
    ],
    "max_min_diversity": [((_t(1, 2928, 4096), _t(1, 2928, dtype=torch.bool), _t(1, dtype=torch.int64), 732), {})],
    "dpp_greedy": [((_t(5, 576, 1024), _t(5, 576), _t(5, 576, dtype=torch.bool), 144, 1e-4), {})],
    "duplicate_removal": [
        ((_t(5, 576, 1024), _t(5, 576, dtype=torch.int64), _t(5, dtype=torch.int64), _t(5, dtype=torch.int64), 32), {})
    ],  # fmt: skip
    "greedy_least_similar": [((_t(1, 8, 576), _t(1, 576, dtype=torch.bool), _t(1, 8, dtype=torch.int64)), {})],
    "static_windows": [((_t(1, 32, 32), 1024), {})],
    "fill_gaps": [
        (
            (
                _t(2, 32, dtype=torch.int64),
                _t(2, 32, dtype=torch.bool),
                _t(2, 32, dtype=torch.int64),
                _t(2, 32, dtype=torch.int64),
            ),
            {},
        )
    ],  # fmt: skip
    "anchored_prediction": [
        (
            (
                _t(2 * 1024, 1176),
                _t(2, dtype=torch.int64),
                _t(2, dtype=torch.int64),
                _t(2, dtype=torch.int64),
                0.05,
                "max",
            ),
            {},
        )
    ],  # fmt: skip
    "visual_attention": [
        (
            (
                _t(1, 32, 40, 128, dtype=torch.bfloat16),
                _t(1, 8, 700, 128, dtype=torch.bfloat16),
                _t(1, 40, dtype=torch.int64),
                _t(1, 700, dtype=torch.bool),
                _t(1, 576, dtype=torch.int64),
                128**-0.5,
            ),
            {},
        )
    ],  # fmt: skip
    "rotary_visual_attention": [
        (
            (
                _t(1, 700, 32, 128, dtype=torch.bfloat16),
                _t(1, 8, 700, 128, dtype=torch.bfloat16),
                _t(1, 700, 128, dtype=torch.bfloat16),
                _t(1, 700, 128, dtype=torch.bfloat16),
                _t(1, 40, dtype=torch.int64),
                _t(1, 700, dtype=torch.bool),
                _t(1, 576, dtype=torch.int64),
                128**-0.5,
                rotate,
            ),
            {},
        )
        for rotate in (True, False)
    ],  # fmt: skip
}
# ops whose CUDA implementation cannot run here, with the reason (strict xfails: none today; MMTok's greedy no longer
# replays CUDA graphs, it launches its step kernel like SCOPE's)
ELSEWHERE: dict[str, str] = {}


def _ops() -> list[str]:
    return sorted(name for name in dir(torch.ops.vtoken) if name != "name" and not name.startswith("_"))


def _cuda_implementation(name: str):
    qualname = f"vtoken::{name}"
    if qualname in dispatch.CUDA_KERNELS:
        return dispatch.CUDA_KERNELS[qualname]
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[qualname]._backend_fns.get("cuda")


def test_every_op_has_a_case_and_a_cuda_implementation():
    assert set(_ops()) == set(CASES), "a new vtoken:: op needs its meta case here"
    assert all(_cuda_implementation(name) is not None for name in CASES)


class _Launches:
    """Stands in for `kernel[grid](...)`: records each launch's kernel, grid and arguments, launches nothing."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple, tuple, dict]] = []

    def __call__(self, interface, grid):
        def launch(*args, **kwargs):
            self.seen.append((getattr(interface, "__name__", type(interface).__name__), grid, args, kwargs))

        return launch


def _grid(grid, kwargs) -> tuple:
    if callable(grid):  # autotuned: the grid of the meta-parameters a configuration gives
        grid = grid({"BLOCK_M": 128, "BLOCK_N": 64, **kwargs})
    return tuple(grid)


@pytest.mark.parametrize(
    "name, case",
    [pytest.param(name, i, marks=[pytest.mark.xfail(strict=True, reason=ELSEWHERE[name])] if name in ELSEWHERE else [])
     for name in sorted(CASES) for i in range(len(CASES[name]))],
)  # fmt: skip
def test_cuda_implementation_reads_nothing_back(name, case, monkeypatch):
    launches = _Launches()
    monkeypatch.setattr(KernelInterface, "__getitem__", lambda self, grid: launches(self, grid))
    args, kwargs = CASES[name][case]
    implementation = _cuda_implementation(name)
    with count_launches() as counted:
        out = implementation(*args, **kwargs)
    assert counted.syncs == 0, counted.describe()
    assert launches.seen, f"{name}: no kernel launched"
    for kernel, grid, launch_args, launch_kwargs in launches.seen:
        grid = _grid(grid, launch_kwargs)
        assert grid and all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid), (kernel, grid)
        for value in [*launch_args, *launch_kwargs.values()]:
            assert isinstance(value, (torch.Tensor, *SCALARS)), (kernel, type(value))
            assert not (isinstance(value, torch.Tensor) and value.dim() == 0), f"{kernel}: a 0-d tensor argument"
    fake = getattr(torch.ops.vtoken, name)(*args, **kwargs)  # the registered fake: the op's promised shapes
    outs = out if isinstance(out, tuple) else (out,)
    fakes = fake if isinstance(fake, tuple) else (fake,)
    assert [(o.shape, o.dtype) for o in outs] == [(f.shape, f.dtype) for f in fakes]


@pytest.fixture
def without_triton(monkeypatch):
    """`register_cuda` as it runs where triton is not installed, and a fresh once-per-process warning."""
    monkeypatch.setattr(dispatch, "triton", None)
    monkeypatch.setattr(dispatch, "_warned", False)


def _test_op(name: str, host_loop: bool):
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = torch.library.custom_op(f"vtoken_test::{name}", double, mutates_args=())
    dispatch.register_cuda(op, lambda x: x * 3, double, host_loop=host_loop)
    return op


def test_without_triton_a_cuda_tensor_gets_one_warning_naming_the_install(without_triton):
    _test_op("warned", host_loop=False)
    implementation = dispatch.CUDA_KERNELS["vtoken_test::warned"]
    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(implementation(x), x * 2)  # the reference
        implementation(x)
    assert len(caught) == 1 and caught[0].category is dispatch.KernelsMissingWarning
    assert 'pip install "vtoken[kernels]"' in str(caught[0].message)
    assert "vtoken_test::warned" in str(caught[0].message)


def test_without_triton_a_host_looping_reference_is_refused(without_triton):
    _test_op("refused", host_loop=True)
    with pytest.raises(VTokenError, match=r"vtoken_test::refused on a CUDA tensor needs triton.*pip install"):
        dispatch.CUDA_KERNELS["vtoken_test::refused"](torch.ones(3))


def test_with_triton_the_kernel_is_registered():
    from torch._library.custom_ops import OPDEFS

    _test_op("kernel", host_loop=True)
    assert torch.equal(dispatch.CUDA_KERNELS["vtoken_test::kernel"](torch.ones(2)), torch.full((2,), 3.0))
    assert OPDEFS["vtoken_test::kernel"]._backend_fns.get("cuda") is not None  # what the dispatcher runs for CUDA


@pytest.mark.parametrize("module, name", [("diversity", "max_min_diversity"), ("duplicates", "duplicate_removal"),
                                          ("static_windows", "static_windows"), ("segment_gaps", "fill_gaps"),
                                          ("pixel_prediction", "anchored_prediction")])  # fmt: skip
def test_host_looping_references_are_the_ones_refused(module, name):
    """The references that read the device back (`.tolist()` of counts, `.cpu()`) are registered as host loops."""
    import importlib
    import inspect

    source = importlib.import_module(f"vtoken.kernels.{module}")
    reference = inspect.getsource(getattr(source, f"{name}_reference"))
    assert ".tolist()" in reference or ".cpu()" in reference
    assert "host_loop=True" in inspect.getsource(source)
