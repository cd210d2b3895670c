"""The launch counter (vtoken.launches): what it calls a kernel and a sync, so that tests built on it can fail."""

import pytest
import torch

from vtoken.launches import count_launches, no_host_syncs

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
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_is_counted_once_with_its_site(name):
    with count_launches() as counted:
        SYNCS[name]()
    assert counted.syncs == 1, counted.describe()
    assert "test_launches.py" in counted.sync_sites[0]


FREE = {
    "views": lambda: x.view(2, 3).t().unsqueeze(0)[:, 1:].expand(4, 2, 2),
    "empty": lambda: torch.empty(3),
    "scalar argument": lambda: torch.where(x > 0, x, 0),
    "repeat_interleave with output_size": lambda: torch.arange(3).repeat_interleave(torch.arange(3), output_size=3),
    "top-k and sort": lambda: (x.topk(2), x.sort(stable=True)),
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
