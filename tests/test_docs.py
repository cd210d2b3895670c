"""The docs stay true: every ```python block of README.md and docs/ runs, and the MkDocs site builds strictly.

Blocks of one page run in order in one namespace, as a reader pastes them. A block that loads a hub checkpoint runs
on a built-in tiny model of the same family (HUB below; docs/contributing.md lists it). A block preceded by the line
`<!-- docs-test: skip (reason) -->` is not run (for the rare block that needs a GPU server or a download).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
SKIP = "<!-- docs-test: skip"
# hub id in the docs -> (zoo builder, its keyword arguments): the built-in model the block runs on instead
HUB = {
    "llava-hf/llava-1.5-7b-hf": ("tiny_llava", {"text_layers": 4}),  # 4 layers: FastV's default layer 2 fits
    "llava-hf/llava-v1.6-vicuna-7b-hf": ("tiny_llava_next", {}),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("tiny_qwen2_5_vl", {}),
}


def code_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) of every ```python block of `path`."""
    text = path.read_text()
    out = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((line, match.group(1), before.strip().startswith(SKIP)))
    return out


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture
def hub_substitution(monkeypatch):
    """`from_pretrained(hub id)` of the model and processor classes returns the tiny model HUB names (built once per
    id and test, model and processor from the same build)."""
    import transformers

    import vtoken.zoo as zoo

    built: dict[str, tuple] = {}

    def resolve(name: str):
        if name not in HUB:
            raise AssertionError(f"the docs load {name!r}, which has no built-in stand-in: add it to HUB in "
                                 "tests/test_docs.py (and docs/contributing.md), or use a built-in model")  # fmt: skip
        if name not in built:
            builder, kwargs = HUB[name]
            built[name] = getattr(zoo, builder)(**kwargs)
        return built[name]

    def substitute(cls, index: int):
        original = cls.from_pretrained.__func__

        def from_pretrained(cls, name, *args, **kwargs):
            if Path(str(name)).exists():  # a local checkpoint (vtoken-mini's weights): loaded as it is
                return original(cls, name, *args, **kwargs)
            return resolve(str(name))[index]

        monkeypatch.setattr(cls, "from_pretrained", classmethod(from_pretrained))

    for name in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "LlavaForConditionalGeneration"):
        if hasattr(transformers, name):  # AutoModelForVision2Seq: gone in transformers 5
            substitute(getattr(transformers, name), 0)
    substitute(transformers.AutoProcessor, 1)


RUNNABLE = [p for p in PAGES if any(not skip for _, _, skip in code_blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_code_blocks_run(page, hub_substitution, capsys):
    namespace = {"__name__": f"docs:{_name(page)}"}
    for line, code, skip in code_blocks(page):
        if skip:
            continue
        try:
            # dont_inherit: a block runs as a reader pastes it, not under this module's `from __future__` imports
            exec(compile(code, f"{_name(page)}:{line}", "exec", dont_inherit=True), namespace)
        except SystemExit as done:  # a block calling the CLI's main() ends with its status
            assert done.code in (0, None), f"{_name(page)}:{line} exited with {done.code}"
        except Exception as err:
            raise AssertionError(f"the code block at {_name(page)}:{line} fails: {type(err).__name__}: {err}") from err


def test_the_collector_finds_the_blocks():
    """The collector sees the README's example and skips only marked blocks (so the test above can fail)."""
    readme = code_blocks(ROOT / "README.md")
    assert readme and not any(skip for _, _, skip in readme)
    assert "vtoken.patch(" in readme[0][1]
    skipped = [(p, line) for p in PAGES for line, _, skip in code_blocks(p) if skip]
    assert len(skipped) <= 3, f"blocks skipped by the docs test should be rare: {skipped}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, anchor or nav entry, a missing snippet or an unresolvable API
    reference fails."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the docs extra is not installed ({err}); CI must build the site")
        pytest.skip(f"the docs extra is not installed: {err}")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "api" / "index.html").read_text().count("doc-heading") > 5
