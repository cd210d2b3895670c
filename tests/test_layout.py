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


def _import_graph() -> dict[str, set[str]]:
    """Module -> the vtoken modules it imports, anywhere in its file (lazy imports inside functions too; not what
    only type checkers read, under `if TYPE_CHECKING:`). `from package import name` depends on the module `name`
    when it is one, else on the package itself; a package's own implicit import by its submodules is not an edge."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        pending = [ast.parse(path.read_text())]
        while pending:
            node = pending.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                    continue
                pending.append(child)
                if isinstance(child, ast.Import):
                    found |= {a.name for a in child.names if a.name.startswith("vtoken")}
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".")[: len(package.split(".")) - child.level + 1]
                        target = ".".join(base + ([child.module] if child.module else []))
                    else:
                        target = child.module or ""
                    if target.startswith("vtoken"):
                        found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                                  for a in child.names}  # fmt: skip
        resolved = set()
        for target in found:
            while target and target not in modules:  # `import vtoken.x.y` names a module; a class's owner module
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_anywhere():
    """The package's import graph, lazy imports included, has no circle: every module can be read knowing only what
    it imports (the registry finds methods and families; none of them imports the registry back)."""
    graph = _import_graph()
    assert "vtoken.adapters.hf" in graph["vtoken.adapters.base"]  # the walk sees `from . import hf`
    assert "vtoken.adapters.families" in graph["vtoken.registry"]  # and lazy imports
    assert _circles(graph) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the search finds one
