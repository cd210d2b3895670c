"""The code's layout: which parts of the package may import which (read statically from the source, lazy imports
inside functions included), so a newcomer reading one part does not have to read its importers too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vtoken"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every vtoken module `path` imports, anywhere in the file (top level or inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vtoken"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("vtoken"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` imports module x
    return found


def _group_imports(group: str) -> set[str]:
    """Modules imported by any module of `group` (a package such as vtoken.zoo, or a module such as vtoken.cli)."""
    path = ROOT.parent / group.replace(".", "/")
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    assert files, group
    return set().union(*(_imports(f) for f in files))


def _reaches(imports: set[str], group: str) -> list[str]:
    return sorted(i for i in imports if i == group or i.startswith(group + "."))


def test_zoo_is_a_package_of_family_modules():
    assert (ROOT / "zoo" / "__init__.py").is_file()
    assert not list(ROOT.glob("zoo*.py")), "the tiny-model builders live in vtoken/zoo/, not beside the core"
    from vtoken.zoo import TINY_MODELS, tiny_llava

    assert TINY_MODELS["tiny-llava"] is tiny_llava


def test_mini_does_not_import_the_zoo():
    # the zoo loads vtoken-mini by name (zoo -> mini); mini builds from vtoken.parts, never from the zoo
    assert _reaches(_group_imports("vtoken.zoo"), "vtoken.mini")  # the direction that is allowed (guards the parse)
    assert _reaches(_group_imports("vtoken.mini"), "vtoken.zoo") == []


def test_cli_and_demo_do_not_import_each_other_in_a_circle():
    assert _reaches(_group_imports("vtoken.demo"), "vtoken.cli") == []
    # the CLI starts the demo (cli -> demo), a one-way dependency
    assert _reaches(_group_imports("vtoken.cli"), "vtoken.demo")


def test_the_parse_sees_relative_imports():
    # the reader above must resolve `from ..x import y` inside a package, else the checks could pass vacuously
    assert "vtoken.parts" in _imports(ROOT / "zoo" / "llava.py")
    assert "vtoken.zoo.common" in _imports(ROOT / "zoo" / "llava.py")
