"""kernels/ and adapters/ install only as vtoken.kernels / vtoken.adapters, but where the repository's root is on
sys.path (`python -m pytest`, a script run from a checkout) they are importable as top-level `kernels` and
`adapters` too, and transformers imports `kernels` when it probes for the Hugging Face package of that name. Imported
so, they must register nothing: a second definition of a custom op replaces the first and leaves every handle to it
dangling (seen as `vector::reserve`, corrupted overload names and crashes in MMTok, DivPrune and VisPruner), and a
second registration of the adapters duplicates every family. Run in a fresh interpreter, from the root."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib, sys
sys.path.insert(0, "")  # the repository's root, as `python -m pytest` and `python script.py` have it
import torch
import vtoken, vtoken.adapters, vtoken.methods
from vtoken.registry import ADAPTERS
from vtoken.zoo import TINY_MODELS
TINY_MODELS["tiny-llava"]()  # transformers probes for `kernels` on the way
importlib.import_module("kernels"), importlib.import_module("adapters")  # and anyone else may
shadows = sorted(k for k in sys.modules if k.split(".")[0] in ("kernels", "adapters") and "." in k)
assert not shadows, f"imported twice, under top-level names: {shadows}"
assert len(ADAPTERS) == len({c.__qualname__ for c in ADAPTERS}), [c.__qualname__ for c in ADAPTERS]
coverage = torch.rand(2, 5, 7)
picks = torch.ops.vtoken.greedy_max_coverage(coverage, torch.zeros(2, 7, dtype=torch.bool), torch.tensor([3, 2]), 3)
assert picks.shape == (2, 3), picks
print("ok")
"""


def test_top_level_names_register_nothing():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
