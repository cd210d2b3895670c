"""Uncertainty of accuracy-like numbers: every accuracy and retention vtoken reports comes with n, a standard error
and a 95 % interval.

- A mean of per-sample scores (`mean_estimate`): the standard error is the samples' standard deviation / sqrt(n)
  (what lmms-eval prints as stderr). The interval is Wilson's score interval when every score is 0 or 1 (exact
  enough at small n and never outside [0, 1]), else mean +- 1.96 standard errors.
- A retention, pruned score / unpruned score on the same samples (`ratio_estimate`): the ratio of the means with
  a paired delta-method standard error, se = sd(a_i - r b_i) / (sqrt(n) mean(b)), and r +- 1.96 se.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


@dataclass(frozen=True)
class Estimate:
    """A number with its uncertainty: value, standard error, 95 % interval [low, high] and sample count n."""

    value: float
    se: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 3) -> str:
        """'0.812 ± 0.025 [0.758, 0.857] n=250' (± one standard error, brackets: the 95 % interval)."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.value)} ± {f.format(self.se)} "
                f"[{f.format(self.low)}, {f.format(self.high)}] n={self.n}")  # fmt: skip

    def to_dict(self) -> dict:
        return {"value": self.value, "se": self.se, "ci95": [self.low, self.high], "n": self.n}


def _sd(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion of `successes` out of `n`."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, min(centre - half, p)), min(1.0, max(centre + half, p))  # round-off never excludes p


def mean_estimate(scores: Sequence[float]) -> Estimate:
    """The mean of per-sample `scores` with its standard error and 95 % interval (see the module docstring)."""
    scores = [float(s) for s in scores]
    n = len(scores)
    if n == 0:
        raise ValueError("no samples: a mean needs at least one score")
    value = sum(scores) / n
    se = _sd(scores) / math.sqrt(n)
    if all(s in (0.0, 1.0) for s in scores):
        low, high = wilson(sum(scores), n)
    else:
        low, high = value - Z95 * se, value + Z95 * se
    return Estimate(value, se, low, high, n)


def ratio_estimate(pruned: Sequence[float], unpruned: Sequence[float]) -> Estimate | None:
    """mean(pruned) / mean(unpruned) over the same samples (paired, in the same order) with a delta-method
    standard error and 95 % interval; None when the unpruned mean is 0 (no retention to speak of)."""
    if len(pruned) != len(unpruned):
        raise ValueError(f"retention needs paired samples; got {len(pruned)} and {len(unpruned)} scores")
    n = len(pruned)
    if n == 0:
        raise ValueError("no samples: a retention needs at least one pair")
    a, b = sum(pruned) / n, sum(unpruned) / n
    if b == 0:
        return None
    r = a / b
    se = _sd([x - r * y for x, y in zip(pruned, unpruned, strict=True)]) / (math.sqrt(n) * b)
    return Estimate(r, se, max(0.0, r - Z95 * se), r + Z95 * se, n)  # a retention is never negative
