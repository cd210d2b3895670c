"""The repository's root is a safe place to start Python: no folder in it hides a package the dependencies bring.

`python -m pytest`, `python script.py` and `python -c ...` started in a checkout put the root on `sys.path`, ahead
of site-packages. transformers >= 5.25 imports Hugging Face's `kernels` package on `from transformers import ...`,
and AdapterHub's package is called `adapters`: vtoken's code lives under `vtoken/` only (`vtoken.kernels`,
`vtoken.adapters`), so those names reach the installed packages. Each check runs in a fresh interpreter, in the
root, as a user's script would."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# names the dependencies bring (or may): none may be a top-level module or package of the repository
GUARDED = ("kernels", "adapters")


def _run(script: str, env_path: Path | None = None) -> subprocess.CompletedProcess:
    env = None
    if env_path is not None:
        import os

        env = dict(os.environ, PYTHONPATH=str(env_path))  # after the root ('' / the script's folder), as a site dir
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )


def _stand_in(site: Path, name: str) -> None:
    """A distribution `name` 0.0.1 installed into `site`: its package and its metadata, as pip leaves them."""
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"STAND_IN = {name!r}\n__version__ = '0.0.1'\n")
    info = site / f"{name}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    (info / "RECORD").write_text("")


def test_no_top_level_name_of_the_repository_hides_a_dependency():
    """Nothing importable in the root under a name a dependency brings: not a package, not a module."""
    found = [n for n in GUARDED if (ROOT / n / "__init__.py").exists() or (ROOT / f"{n}.py").exists()]
    assert not found, f"top-level {found} in the repository would hide the installed packages of those names"


def test_installed_packages_win_from_the_root(tmp_path):
    """With stand-in `kernels` and `adapters` distributions installed, Python started in the root imports them,
    while vtoken's own kernels and families register under `vtoken.*` once (fails where the root has them)."""
    for name in GUARDED:
        _stand_in(tmp_path, name)
    script = textwrap.dedent(
        f"""
        import importlib.metadata, sys
        assert sys.path[0] == "", sys.path[:2]  # the root first, as `python -c` / `python -m pytest` have it
        import kernels, adapters
        for module in (kernels, adapters):
            assert getattr(module, "STAND_IN", None) == module.__name__, (module.__name__, module.__file__)
            assert module.__file__.startswith({str(tmp_path)!r}), module.__file__
            assert importlib.metadata.version(module.__name__) == "0.0.1"
        import torch
        import vtoken.kernels
        coverage = torch.rand(2, 5, 7)
        picks = torch.ops.vtoken.greedy_max_coverage(
            coverage, torch.zeros(2, 7, dtype=torch.bool), torch.tensor([3, 2]), 3
        )
        assert picks.shape == (2, 3), picks
        print("ok")
        """
    )
    run = _run(script, tmp_path)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.skipif(
    importlib.util.find_spec("kernels") is None, reason="transformers < 5.25 without Hugging Face's kernels"
)
def test_transformers_imports_its_kernels_package_from_the_root():
    """With the real `kernels` installed (transformers >= 5.25 depends on it; the lock installs it): from the root,
    transformers imports and the README's example runs (vtoken-mini, patched generate)."""
    script = textwrap.dedent(
        """
        import importlib.metadata, kernels
        assert importlib.metadata.version("kernels"), kernels.__file__
        from transformers import LlamaConfig  # imports `kernels` on transformers >= 5.25
        import vtoken
        from vtoken.mini import example
        from vtoken.registry import adapters
        from vtoken.zoo import build_prompt, load
        names = [c.__qualname__ for c in adapters()]
        assert len(names) == len(set(names)), names  # every family registered once
        model, processor = load("vtoken-mini")  # the README's first example
        image, question, answer = example()
        inputs = processor(images=image, text=build_prompt(processor, question), return_tensors="pt")
        with vtoken.patched(model, "fastervlm", budget=0.25) as handle:
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 2 and handle.records, out.shape
        print(LlamaConfig.__name__, "ok")
        """
    )
    run = _run(script)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
