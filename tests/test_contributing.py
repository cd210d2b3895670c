"""Small changes stay small (docs/guide/contributing-code.md): a new method is its file, its reference test and its
docs row. A throwaway method is added to a copy of the package, nothing else edited, and every tool finds it: the
registry, `vtoken.<Class>` and `__all__`, `applicable_methods`, `vtoken.patch` + generate with its records, the
CLI, the demo's controls and the vLLM plugin's start check; and the docs' tables name every registered method."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import vtoken

ROOT = Path(__file__).resolve().parents[1]

THROWAWAY = '''
"""A throwaway method for tests/test_contributing.py: keep each crop's tokens with the largest feature norm."""

from dataclasses import dataclass

import torch

from .base import ScoreMethod
from ..params import Real


@dataclass
class Throwaway(ScoreMethod):
    """Keep each crop's tokens with the largest feature p-norm."""

    power: float = 2.0

    name = "throwaway"
    requires = ("vision_features",)
    params = {"power": Real("(0, inf)", hint="the norm's order")}

    def score(self, tokens):
        return tokens.signals["vision_features"].float().norm(p=self.power, dim=-1)
'''

CHECKS = """
import contextlib, io, sys
import vtoken
from vtoken.applicability import applicable_methods
from vtoken.cli import main
from vtoken.demo.controls import control_specs
from vtoken.zoo import build_prompt, tiny_llava
from PIL import Image

assert vtoken.methods.__file__.startswith(sys.argv[1]), vtoken.methods.__file__  # the copy, not the checkout
assert "throwaway" in vtoken.available_methods() and "Throwaway" in vtoken.__all__
assert vtoken.Throwaway is vtoken.registry.method_class("throwaway")
model, processor = tiny_llava()
assert applicable_methods(model)["throwaway"] is None, applicable_methods(model)["throwaway"]
image = Image.new("RGB", (64, 48), (200, 30, 30))
inputs = processor(images=image, text=build_prompt(processor, "what colour?"), return_tensors="pt")
with vtoken.patched(model, "throwaway", budget=0.25, power=1.0) as handle:
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert [r.tokens_out for r in handle.records] == [144], handle.records
assert [c.param for c in control_specs() if c.method == "throwaway"] == ["budget", "scope", "power"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["run", "--model", "tiny-llava", "--method", "throwaway", "--param", "power=3", "--budget", "0.5",
          "--max-new-tokens", "1"])
assert "throwaway" in out.getvalue(), out.getvalue()
print("ok")
"""


def test_a_new_method_is_its_file(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "vtoken", copy / "vtoken", ignore=shutil.ignore_patterns("__pycache__", "weights"))
    (copy / "vtoken" / "mini" / "weights").symlink_to(ROOT / "vtoken" / "mini" / "weights")
    (copy / "vtoken" / "methods" / "throwaway.py").write_text(textwrap.dedent(THROWAWAY))
    env = dict(os.environ, PYTHONPATH=str(copy))
    run = subprocess.run([sys.executable, "-c", CHECKS, str(copy)], cwd=copy, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_the_docs_table_names_every_method():
    """Every registered built-in has its row in docs/guide/methods.md, the one table of methods (its docs row)."""
    table = (ROOT / "docs" / "guide" / "methods.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M))
    builtins = {cls.name for cls in vars(vtoken.methods).values() if isinstance(cls, type) and getattr(cls, "name", "")}
    assert builtins - rows == set(), f"methods without a row in docs/guide/methods.md: {sorted(builtins - rows)}"
    assert rows - builtins == set(), f"rows naming no registered method: {sorted(rows - builtins)}"
