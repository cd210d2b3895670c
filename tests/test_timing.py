"""The timing rule (vtoken.timing) on synthetic timings: an injected clock and hand-made run lists, no wall clock."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from vtoken.timing import Timing, compare, measure, summary


class FakeClock:
    """A clock that advances only when a setting 'runs': each setting's run takes the next of its durations."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now = 0.0
        self.durations = {k: list(v) for k, v in durations.items()}
        self.order: list[str] = []

    def __call__(self) -> float:
        return self.now

    def setting(self, name: str):
        def run():
            self.order.append(name)
            self.now += self.durations[name].pop(0)

        return run


def test_settings_are_interleaved_with_rotating_order_and_warmup_dropped():
    clock = FakeClock({"a": [9.0, 1.0, 1.1, 1.2], "b": [9.0, 2.0, 2.1, 2.2]})
    timed = measure({"a": clock.setting("a"), "b": clock.setting("b")}, repeats=3, warmup=1, clock=clock)
    assert clock.order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # interleaved, the first of a pair rotates
    assert timed["a"].times == pytest.approx((1.0, 1.1, 1.2))  # the warm-up run (9 s) is not counted
    assert timed["b"].times == pytest.approx((2.0, 2.1, 2.2))


def test_contexts_around_each_run_are_outside_the_timer():
    clock = FakeClock({"patched": [1.0] * 3})
    entered = []

    @contextmanager
    def patched():
        entered.append("in")
        clock.now += 100.0  # patching is slow, but must not be timed
        yield
        clock.now += 100.0

    timed = measure({"patched": clock.setting("patched")}, repeats=2, warmup=1, around={"patched": patched},
                    clock=clock)  # fmt: skip
    assert entered == ["in"] * 3 and timed["patched"].times == (1.0, 1.0)


def test_median_and_spread():
    t = Timing((0.010, 0.014, 0.011, 0.030, 0.012))
    assert (t.median, t.low, t.high, t.n) == (0.012, 0.010, 0.030, 5)
    assert t.ms() == "12.0 ms (10.0-30.0, n=5)"
    assert t.to_dict()["median_ms"] == pytest.approx(12.0)


def test_a_clear_speedup_is_reported_as_one():
    base, fast = Timing((2.0, 2.1, 2.2)), Timing((1.0, 1.05, 1.1))
    r = compare(base, fast)
    assert r.value == pytest.approx(2.1 / 1.05)
    assert (r.low, r.high) == (pytest.approx(2.0 / 1.1), pytest.approx(2.2 / 1.0))
    assert not r.within_noise and r.verdict == "faster"
    assert str(r) == "2.00x faster (1.82-2.20)"
    slow = compare(fast, base)
    assert slow.verdict == "slower" and "slower" in str(slow)


def test_overlapping_spreads_read_within_noise_even_when_the_medians_differ():
    # the case: a setting that prunes nothing printed 1.25x; with spreads that overlap it is noise
    base, same = Timing((1.25, 1.0, 1.3, 0.9, 1.2)), Timing((1.0, 0.95, 1.3, 1.1, 1.0))
    r = compare(base, same)
    assert r.value == pytest.approx(1.2 / 1.0) and r.within_noise
    assert r.verdict == "within noise" and "faster" not in str(r) and "within noise" in str(r)


def test_one_run_has_no_spread_and_makes_no_claim():
    r = compare(Timing((2.0,)), Timing((1.0,)))
    assert r.within_noise and "no spread" in str(r)


def test_keep_all_reads_as_about_one_within_noise():
    # keep-all: the same work each run; the runs differ only by noise drawn from the same distribution
    import random

    rng = random.Random(0)
    draws = {name: [0.1 * (1 + rng.gauss(0, 0.05)) for _ in range(6)] for name in ("unpatched", "keep-all")}
    clock = FakeClock(draws)
    timed = measure({k: clock.setting(k) for k in draws}, repeats=5, warmup=1, clock=clock)
    r = compare(timed["unpatched"], timed["keep-all"])
    assert r.within_noise and abs(r.value - 1) < 0.1
    lines = summary(timed, base="unpatched")
    assert lines[1].startswith("keep-all") and "within noise" in lines[1] and "x faster" not in lines[1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="repeats"):
        measure({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="at least one"):
        Timing(())
    with pytest.raises(ValueError, match=">= 0"):
        Timing((float("nan"),))
