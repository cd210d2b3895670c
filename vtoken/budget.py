"""Budgets: how many visual tokens to keep.

A float in (0, 1] is the fraction kept, k = max(1, floor(fraction * n + 0.5)) (round half up, as the official
FasterVLM runs count: 5 % of 576 is 29). An int >= 1 is a count; a count >= n keeps all n.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

from .errors import BudgetError

if TYPE_CHECKING:  # the CLI's --help reads budgets without importing torch
    import torch

Budget = float | int

ACCEPTED = "a float fraction in (0, 1] (e.g. 0.25) or an int token count >= 1 (e.g. 144)"
# the budget the CLI and the demo start every method's `budget` at (the methods' own defaults follow their papers:
# FasterVLM 0.25, HiRED and MMTok 0.2), so that side-by-side rows keep the same share of tokens
DEFAULT_BUDGET = 0.25


def check_budget(budget: object, name: str = "budget") -> Budget:
    """Return `budget` unchanged if valid, else raise `BudgetError` naming the value and what is accepted."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise BudgetError(f"{name}={budget!r} ({type(budget).__name__}) is not a number; expected {ACCEPTED}.")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise BudgetError(f"{name}={budget} is a token count below 1; expected {ACCEPTED}.")
        return int(budget)
    budget = float(budget)
    if not math.isfinite(budget) or not 0.0 < budget <= 1.0:
        raise BudgetError(f"{name}={budget} is outside (0, 1]; expected {ACCEPTED}.")
    return budget


def tokens_to_keep(budget: Budget, n: int) -> int:
    """Number of tokens kept out of `n` under `budget` (always in [1, n] for n >= 1)."""
    budget = check_budget(budget)
    if isinstance(budget, int):
        return min(budget, n)
    return max(1, min(n, math.floor(budget * n + 0.5)))


def tokens_to_keep_tensor(budget: Budget, n: torch.Tensor) -> torch.Tensor:
    """`tokens_to_keep` of every entry of `n` (integer tensor), computed on n's device without reading it back: the
    same IEEE double arithmetic as the host's, so both sides agree on every count. 0 where n is 0 (a crop without
    tokens keeps none)."""
    budget = check_budget(budget)
    n = n.long()
    if isinstance(budget, int):
        return n.clamp(max=budget)
    return (n.double() * budget + 0.5).floor().long().clamp(min=1).minimum(n)


def describe(budget: Budget) -> str:
    """How a budget reads to a user: 0.25 -> '25%' (a fraction kept), 144 -> '144 tokens' (a count)."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        return repr(budget)
    if isinstance(budget, numbers.Integral):
        return f"{budget} token" if budget == 1 else f"{budget} tokens"
    return f"{float(budget) * 100:.4g}%"


def parse_number(text: str) -> Budget:
    """A budget written as text, not yet checked: '0.25' -> 0.25 (a fraction), '144' -> 144 (a count)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    raise BudgetError(f"budget {text!r} is neither a fraction like 0.25 nor a count like 144")


def parse_budget(text: str) -> Budget:
    """A budget written as text (a command line, a config), checked: see `check_budget`."""
    return check_budget(parse_number(text))
