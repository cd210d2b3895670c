"""`make compat`'s two steps: the requirements with upper bounds lifted, and the report on the suite's junit XML.

    python tools/compat.py requirements pyproject.toml > reqs.txt   # every dependency of every extra, no upper bounds
    python tools/compat.py report junit.xml --lock requirements.lock

The report prints the key packages' versions beside the lock's, the failures grouped by test file, and each failing
contract test (tests/test_transformers_contract.py) with the first line of its message: one test per assumption about
transformers, so a new release's break reads as a few named lines. It exits 1 when a test failed, 0 when none did.
Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

CONTRACT_FILE = "tests/test_transformers_contract.py"
KEY_PACKAGES = (
    "torch", "torchvision", "triton", "transformers", "tokenizers", "huggingface-hub", "accelerate", "lmms-eval",
    "datasets", "filelock", "gradio", "timm", "open-clip-torch", "numpy", "pillow",
)  # fmt: skip
PIP_CAP = Path("/etc/xdg/pip/constraints.txt")

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
_SPEC = re.compile(r"(===|~=|==|!=|<=|>=|<|>)\s*([^,\s]+)")


def normalize(name: str) -> str:
    """A distribution name in PEP 503 form: `Open_Clip.torch` -> `open-clip-torch`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def unbounded(requirement: str) -> str:
    """`requirement` with its upper bounds lifted: `<`, `<=` dropped, `==`/`===`/`~=` turned into `>=`; lower bounds,
    exclusions (`!=`), extras and environment markers kept. `"a[x]>=1,<2; python_version<'3.12'"` ->
    `"a[x]>=1; python_version<'3.12'"`."""
    head, _, marker = requirement.partition(";")
    match = _NAME.match(head)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r} (expected NAME[EXTRAS] SPECIFIERS [; MARKER])")
    name, extras, specs = match.group(1), match.group(2) or "", match.group(3)
    if "@" in specs:
        raise ValueError(f"a direct reference cannot be unbounded: {requirement!r}")
    kept = []
    for op, version in _SPEC.findall(specs):
        if op in (">=", ">", "!="):
            kept.append(op + version)
        elif op in ("==", "===", "~="):
            kept.append(">=" + version.removesuffix(".*"))
    out = name + extras + ",".join(kept)
    return out + ";" + marker if marker.strip() else out


def requirements(pyproject: Path) -> list[str]:
    """Every requirement of the project and of all its extras, upper bounds lifted, each once, in file order (an
    extra that names the project itself, like `all = ["vtoken[...]"]`, adds nothing new and is left out)."""
    try:
        import tomllib
    except ModuleNotFoundError as err:  # Python 3.10
        raise SystemExit("tools/compat.py needs Python 3.11+ (tomllib): run it with PYTHON=python3.11") from err
    project = tomllib.loads(pyproject.read_text())["project"]
    own = normalize(project["name"])
    found = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        found.extend(extra)
    out: list[str] = []
    for requirement in found:
        match = _NAME.match(requirement)
        if match is None or normalize(match.group(1)) == own:
            continue
        lifted = unbounded(requirement)
        if lifted not in out:
            out.append(lifted)
    return out


@dataclass(frozen=True)
class Outcome:
    """One test case of a junit report: its file, its name within the file, passed/failed/error/skipped, and the
    first line of its failure or error message (empty when it passed)."""

    file: str
    name: str
    outcome: str
    message: str


def _file_of(classname: str, name: str) -> tuple[str, str]:
    """pytest's junit `classname` (`tests.test_x` or `tests.test_x.TestCase`) and `name` -> (file, test name). A
    collection error has an empty classname and the module's dotted path as its name."""
    dotted, test = (classname, name) if classname else (name, "<collection>")
    parts = dotted.split(".")
    module = next((i for i, part in enumerate(parts) if part.startswith("test_") or part.endswith("_test")), None)
    if module is None:
        return dotted.replace(".", "/"), test
    inner = ".".join(parts[module + 1 :])
    return "/".join(parts[: module + 1]) + ".py", f"{inner}::{test}" if inner else test


def _first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0][:240] if lines else ""


def parse_junit(path: Path) -> list[Outcome]:
    """Every test case in a pytest junit XML report (`--junitxml`), in report order."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file, name = _file_of(case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = _first_line(child.get("message")) or _first_line(child.text)
                if message == "collection failure":  # pytest's generic text: the raised error is in the traceback
                    raised = [line[1:].strip() for line in (child.text or "").splitlines() if line.startswith("E ")]
                    message = _first_line("\n".join(raised)) or message
                break
        outcomes.append(Outcome(file, name, outcome, message))
    return outcomes


def lock_versions(path: Path) -> dict[str, str]:
    """`name==version` lines of a lock file -> {normalized name: version}."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def installed_versions() -> dict[str, str]:
    """{normalized name: version} of every distribution the running interpreter sees."""
    return {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}


def cap_lines(path: Path) -> dict[str, str]:
    """pip's machine-wide constraints (the torch cap) -> {normalized name: constraint line}."""
    if not path.is_file():
        return {}
    caps = {}
    for line in path.read_text().splitlines():
        match = _NAME.match(line.split("#")[0])
        if match and line.strip():
            caps[normalize(match.group(1))] = line.strip()
    return caps


def report(outcomes: list[Outcome], installed: dict[str, str], locked: dict[str, str], caps: dict[str, str],
           python: str = platform.python_version()) -> str:  # fmt: skip
    """The text `make compat` prints: versions, then counts, failures by file, and the failing contract tests."""
    lines = [f"== versions (installed / requirements.lock), Python {python}"]
    for name in KEY_PACKAGES:
        have, lock = installed.get(name, "-"), locked.get(name, "-")
        note = "  differs from the lock" if have != lock and have != "-" and lock != "-" else ""
        if name in caps:
            note += f"  (pip's machine-wide cap: {caps[name]})"
        lines.append(f"  {name:<16} {have:<14} {lock:<14}{note}".rstrip())
    others = sorted(n for n in installed if n in locked and installed[n] != locked[n] and n not in KEY_PACKAGES)
    if others:
        shown = ", ".join(f"{n} {installed[n]} (lock {locked[n]})" for n in others[:12])
        shown += ", ..." if len(others) > 12 else ""
        lines.append(f"  {len(others)} other packages differ from the lock: {shown}")

    counts = defaultdict(int)
    for outcome in outcomes:
        counts[outcome.outcome] += 1
    lines.append("== tests: " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped")))
    bad = [o for o in outcomes if o.outcome in ("failed", "error")]
    by_file: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in bad:
        by_file[outcome.file].append(outcome)
    if by_file:
        lines.append("failures by test file (count, first tests, the most common first message line):")
        for file, cases in sorted(by_file.items(), key=lambda item: (-len(item[1]), item[0])):
            names = ", ".join(c.name for c in cases[:3]) + (", ..." if len(cases) > 3 else "")
            lines.append(f"  {file:<42} {len(cases):>4}  {names[:120]}")
            message, count = Counter(c.message or c.outcome for c in cases).most_common(1)[0]
            lines.append(f"      {count}x {message[:160]}")

    contract = [o for o in outcomes if o.file == CONTRACT_FILE]
    broken = [o for o in contract if o.outcome in ("failed", "error")]
    if not contract:
        lines.append(f"== contract tests: none ran ({CONTRACT_FILE})")
    elif not broken:
        lines.append(f"== contract tests: all {len(contract)} passed")
    else:
        lines.append(f"== contract tests: {len(broken)} of {len(contract)} failing")
        lines.extend(f"  {o.name}: {o.message or o.outcome}" for o in broken)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    reqs = commands.add_parser("requirements", help="every requirement of every extra, upper bounds lifted")
    reqs.add_argument("pyproject", type=Path)
    rep = commands.add_parser("report", help="versions and failures of a pytest junit XML report")
    rep.add_argument("junit", type=Path)
    rep.add_argument("--lock", type=Path, required=True)
    rep.add_argument("--cap", type=Path, default=PIP_CAP, help="pip's machine-wide constraints file, if any")
    args = parser.parse_args(argv)
    if args.command == "requirements":
        print("\n".join(requirements(args.pyproject)))
        return 0
    if not args.lock.is_file():
        print(f"compat: no lock file at {args.lock} (`make lock` writes requirements.lock at the repository's root)")
        return 2
    if not args.junit.is_file():
        print(f"compat: no junit report at {args.junit}: the test run did not get far enough to write one")
        return 2
    outcomes = parse_junit(args.junit)
    print(report(outcomes, installed_versions(), lock_versions(args.lock), cap_lines(args.cap)))
    return 1 if any(o.outcome in ("failed", "error") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
