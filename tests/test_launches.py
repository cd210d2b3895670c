"""The launch counter (vtoken.launches): what it calls a kernel and a sync, so that tests built on it can fail."""

import pytest
import torch

from vtoken.launches import count_events, count_launches, no_host_syncs

x = torch.randn(6)
zero_d = torch.tensor(2)


@torch.library.custom_op("vtoken_test::double_then_sum", mutates_args=())
def _double_then_sum(t: torch.Tensor) -> torch.Tensor:
    return (t * 2).cumsum(0).sum(0, keepdim=True)  # three ATen ops inside: one launch outside


SYNCS = {
    "item": lambda: x[0].item(),
    "int": lambda: int(x[0]),
    "bool": lambda: bool(x[0] > 0),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "index with a 0-d tensor": lambda: x[zero_d],
    "boolean mask": lambda: x[x > 0],
    "boolean mask assignment": lambda: x.clone().__setitem__(x > 0, 1.0),
    "nonzero": lambda: x.nonzero(),
    "where with one argument": lambda: torch.where(x > 0),
    "unique": lambda: x.unique(),
    "repeat_interleave without output_size": lambda: torch.arange(3).repeat_interleave(torch.arange(3)),
    "torch.tensor(list)": lambda: torch.tensor([1, 2, 3]),
    # blocking host-to-device copies: counted whatever the device is in the test (a CPU stands in for a GPU)
    "a 0-d tensor made on a device": lambda: torch.tensor(3, device=x.device),
    "torch.as_tensor(list) on a device": lambda: torch.as_tensor([1, 2], device=x.device),
    "to(device) of a host scalar": lambda: torch.tensor(2.0).to(x.device),
    "to(device, dtype) of a host scalar": lambda: torch.tensor(2).to(device=x.device, dtype=torch.float32),
    "copy_ from a host scalar": lambda: x[:1].clone().copy_(torch.tensor(1.0)),
    "cpu(): a copy to the host": lambda: x.cpu(),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_is_counted_once_with_its_site(name):
    with count_launches() as counted:
        SYNCS[name]()
    assert counted.syncs == 1, counted.describe()
    assert "test_launches.py" in counted.sync_sites[0]


def test_reading_a_host_copy_is_free():
    """x.cpu().numpy() (or .tolist()) reads the device once: the copy; the host copy's read costs nothing more."""
    for read in (lambda t: t.numpy(), lambda t: t.tolist()):
        with count_launches() as counted:
            read(x.cpu())
        assert counted.syncs == 1, counted.describe()


def test_a_round_trip_through_the_host_is_two_syncs():
    with count_launches() as counted:
        x.cpu().to(x.device)
    assert counted.syncs == 2, counted.describe()
    assert [site.split(" at ")[0] for site in counted.sync_sites] == ["cpu (a copy to the host)", "to of host data"]


FREE = {
    "views": lambda: x.view(2, 3).t().unsqueeze(0)[:, 1:].expand(4, 2, 2),
    "empty": lambda: torch.empty(3),
    "scalar argument": lambda: torch.where(x > 0, x, 0),
    "repeat_interleave with output_size": lambda: torch.arange(3).repeat_interleave(torch.arange(3), output_size=3),
    "top-k and sort": lambda: (x.topk(2), x.sort(stable=True)),
    "a host scalar kept on the host": lambda: torch.tensor(2.0) * 3,
    "a non-blocking copy of host data": lambda: torch.tensor(2.0).to(x.device, non_blocking=True),
    "to(device) of a device tensor": lambda: x.to(x.device),
    "a full tensor of a Python number": lambda: torch.full((3,), 7, device=x.device),
}


@pytest.mark.parametrize("name", list(FREE))
def test_sync_free_code_counts_none(name):
    with count_launches() as counted:
        FREE[name]()
    assert counted.syncs == 0, counted.describe()


def test_kernels_count_ops_not_views():
    with count_launches() as counted:
        y = x.view(2, 3).t()  # views: nothing
        z = (y * 2 + 1).sum()  # mul, add, sum
        torch.empty(4)  # allocation: nothing
        torch.zeros(4)  # a fill
    assert counted.kernels == 4, counted.describe()
    assert counted.ops == {"mul": 1, "add": 1, "sum": 1, "zeros": 1}
    assert z.shape == ()


def test_a_custom_op_is_one_launch():
    with count_launches() as counted:
        out = _double_then_sum(x)
    assert counted.kernels == 1 and counted.syncs == 0, counted.describe()
    assert counted.ops == {"vtoken_test::double_then_sum": 1}
    torch.testing.assert_close(out, (x * 2).cumsum(0).sum(0, keepdim=True))


def test_nested_counts_and_results_unchanged():
    with count_launches() as outer:
        a = x.sort().values
        with count_launches() as inner:
            b = a.cumsum(0)
    assert inner.kernels == 1 and outer.kernels >= 1
    torch.testing.assert_close(b, x.sort().values.cumsum(0))


def test_torch_compile_inside_the_block_is_counted_once():
    """`count_events` sees dynamo compile; under `count_launches`'s dispatch mode dynamo compiles nothing."""
    compiled = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=False)
    t = torch.randn(5)
    with count_launches() as under_modes:
        compiled(t)
    with count_events() as first:
        compiled(t)
    with count_events() as again:
        compiled(t)
    assert under_modes.compiles == 0
    assert first.compiles == 1 and "torch.compile" in first.describe(), first.describe()
    assert again.compiles == 0 and not again.events, again.describe()


def test_graph_captures_autotuning_and_triton_compiles_are_counted(monkeypatch):
    """The hooks the counter installs see what announces each event (CUDA-only calls replaced by stand-ins that
    do nothing, so that the counter's own wrapping is what is tested), in nested counters too, and are removed
    when the last counter closes."""
    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: None)
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *a, **k: None)
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: None)  # no launch: no GPU here
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **k: [float(config.kwargs["B"])])

    @triton.jit
    def kernel(x_ptr, n, B: triton.language.constexpr):
        pass

    tuned = triton.autotune([triton.Config({"B": 16}), triton.Config({"B": 32})], key=["n"])(kernel)
    with count_launches() as outer:
        torch.cuda.CUDAGraph.capture_begin(object())
        JITFunction._do_compile(kernel, None)
        with count_launches() as inner:
            tuned[(1,)](x, 6)  # a new key: the autotuner benchmarks both configurations
        tuned[(1,)](x, 6)  # the same key: its choice is cached
    assert (outer.captures, outer.autotunes, outer.compiles) == (1, 1, 1), outer.describe()
    assert (inner.captures, inner.autotunes, inner.compiles) == (0, 1, 0), inner.describe()
    assert "test_launches.py" in outer.event_sites[0]
    assert Autotuner.__dict__["run"].__name__ == "run"  # the wrapper is gone once no counter is open


def test_no_host_syncs_is_a_no_op_off_cuda():
    with no_host_syncs("cpu"):
        x.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_syncs_raises_on_cuda():
    y = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError), no_host_syncs():
        y[y > 0]
    with no_host_syncs():
        y.topk(3)
