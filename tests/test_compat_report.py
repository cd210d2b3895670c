"""`make compat`'s helper (tools/compat.py): upper bounds lifted from pyproject's requirements, checked with
`packaging`'s own specifier logic, and the report on a junit XML that a real pytest run of a synthetic suite wrote."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compat", ROOT / "tools" / "compat.py")
compat = sys.modules["compat"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(compat)


@pytest.mark.parametrize(
    "requirement",
    ["transformers>=5.19,<5.25", "filelock>=3.16.1,<4.3", "lmms-eval>=0.7.3,<0.8", "gradio>=6,<7", "foo==1.2.3",
     "foo~=2.1", "foo[bar,baz]>=1, <=3; python_version < '3.12'", "foo!=1.5,<2", "foo", "foo==2.*", "foo>1"],
)  # fmt: skip
def test_unbounded_is_the_upward_closure_of_the_original(requirement):
    """A release is allowed after lifting iff some release at or below it was allowed before (and no `!=` names it)."""
    original, lifted = Requirement(requirement), Requirement(compat.unbounded(requirement))
    assert (lifted.name, lifted.extras, str(lifted.marker)) == (original.name, original.extras, str(original.marker))
    probes = ["0.1", "0.7.3", "0.7.9", "1.0", "1.2.3", "1.5", "2.0", "2.1", "2.5", "3.0", "3.16.1", "4.2.12", "4.3.1"]
    probes = [Version(v) for v in [*probes, "5.19.0", "5.24.0", "5.25.0", "6.0", "7.1", "999.0"]]
    excluded = {Version(s.version) for s in original.specifier if s.operator == "!="}
    for version in probes:
        expected = version not in excluded and any(w in original.specifier for w in probes if w <= version)
        assert (version in lifted.specifier) == expected, (str(version), str(lifted))


def test_unbounded_refuses_a_direct_reference():
    with pytest.raises(ValueError, match="direct reference"):
        compat.unbounded("foo @ https://example.invalid/foo.whl")


def test_requirements_cover_every_extra_without_upper_bounds():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    lifted = [Requirement(r) for r in compat.requirements(ROOT / "pyproject.toml")]
    assert {compat.normalize(r.name) for r in lifted} == {
        compat.normalize(r.name) for r in declared if compat.normalize(r.name) != "vtoken"
    }
    assert all(Version("999.0") in r.specifier for r in lifted)
    assert any(r.specifier and any(s.operator in ("<", "<=") for s in r.specifier) for r in declared)  # some lifted


SUITE = {
    "tests/test_transformers_contract.py": """
        import pytest

        def test_cache_kwarg():
            raise AssertionError("5.24 renamed the decoder layers' `past_key_values` kwarg to `cache`\\nsecond line")

        def test_mask_interface():
            pass

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture broke: no AttentionMaskInterface")

        def test_mask_function(broken):
            pass
    """,
    "tests/test_stages.py": """
        import pytest

        @pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
        def test_fastv(family):
            assert family == "gemma3", "size mismatch"

        class TestBatch:
            def test_padded(self):
                assert 1 == 2

        @pytest.mark.skip(reason="needs CUDA")
        def test_cuda():
            pass
    """,
    "tests/test_broken_import.py": "import module_that_does_not_exist\n",
    "tests/test_fine.py": "def test_fine():\n    pass\n",
}


@pytest.fixture(scope="module")
def junit(tmp_path_factory) -> Path:
    """A junit XML written by a real pytest run of SUITE (failures, a setup error, a skip, a collection error), with
    the options `make compat` passes."""
    root = tmp_path_factory.mktemp("suite")
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, source in SUITE.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(textwrap.dedent(source))
    out = root / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out}",
               "--continue-on-collection-errors", "tests"]  # fmt: skip
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_parse_junit_names_file_test_and_first_message_line(junit):
    by_key = {(o.file, o.name): o for o in compat.parse_junit(junit)}
    contract = "tests/test_transformers_contract.py"
    assert by_key[(contract, "test_cache_kwarg")].outcome == "failed"
    assert by_key[(contract, "test_cache_kwarg")].message.endswith("kwarg to `cache`")
    assert by_key[(contract, "test_mask_interface")].outcome == "passed"
    assert by_key[(contract, "test_mask_function")].outcome == "error"
    assert "fixture broke" in by_key[(contract, "test_mask_function")].message
    assert [by_key[("tests/test_stages.py", f"test_fastv[{f}]")].outcome for f in ("llava", "qwen2_vl", "gemma3")] == [
        "failed", "failed", "passed"]  # fmt: skip
    assert by_key[("tests/test_stages.py", "TestBatch::test_padded")].outcome == "failed"
    assert by_key[("tests/test_stages.py", "test_cuda")].outcome == "skipped"
    assert by_key[("tests/test_broken_import.py", "<collection>")].outcome == "error"
    message = "ModuleNotFoundError: No module named 'module_that_does_not_exist'"  # not pytest's "collection failure"
    assert by_key[("tests/test_broken_import.py", "<collection>")].message == message
    assert by_key[("tests/test_fine.py", "test_fine")].outcome == "passed"


def test_report_groups_failures_by_file_and_shows_contract_assumptions(junit, tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.14.1\n    # via vtoken\ntransformers==5.24.0\nfilelock==4.2.12\nsix==1.16.0\n")
    installed = {"torch": "2.14.1", "transformers": "5.25.0", "filelock": "4.2.12", "six": "1.17.0"}
    caps = {"torch": "torch<=2.14.1"}
    outcomes = compat.parse_junit(junit)
    text = compat.report(outcomes, installed, compat.lock_versions(lock), caps, python="3.11.7")
    lines = text.splitlines()
    assert "== tests: 3 passed, 4 failed, 2 error, 1 skipped" in lines
    row = next(line for line in lines if line.split()[:1] == ["transformers"])
    assert row.split()[1:3] == ["5.25.0", "5.24.0"] and "differs from the lock" in row
    row = next(line for line in lines if line.split()[:1] == ["filelock"])
    assert "differs" not in row
    assert "pip's machine-wide cap: torch<=2.14.1" in next(line for line in lines if line.split()[:1] == ["torch"])
    assert "1 other packages differ from the lock: six 1.17.0 (lock 1.16.0)" in text
    files = text[text.index("failures by test file") : text.index("== contract")].splitlines()[1:]
    expected = [("tests/test_stages.py", 3), ("tests/test_transformers_contract.py", 2)]
    expected.append(("tests/test_broken_import.py", 1))
    assert [(f.split()[0], int(f.split()[1])) for f in files[::2]] == expected
    assert files[1] == "      2x AssertionError: size mismatch"  # the most common of the file's three
    assert "ModuleNotFoundError: No module named 'module_that_does_not_exist'" in files[5]
    contract = text[text.index("== contract") :].splitlines()
    assert contract[0] == "== contract tests: 2 of 3 failing"
    renamed = "5.24 renamed the decoder layers' `past_key_values` kwarg to `cache`"
    assert contract[1] == f"  test_cache_kwarg: AssertionError: {renamed}"
    assert contract[2].startswith("  test_mask_function: failed on setup") and "fixture broke" in contract[2]
    assert "second line" not in text


def test_main_exits_by_outcome(junit, tmp_path, capsys):
    lock = tmp_path / "requirements.lock"
    lock.write_text("six==1.16.0\n")
    assert compat.main(["report", str(junit), "--lock", str(lock), "--cap", str(tmp_path / "none")]) == 1
    passing = tmp_path / "passing.xml"
    passing.write_text('<testsuites><testsuite name="pytest" tests="1"><testcase classname="tests.test_a" name="test_b"'
                       ' time="0.1"/></testsuite></testsuites>')  # fmt: skip
    assert compat.main(["report", str(passing), "--lock", str(lock), "--cap", str(tmp_path / "none")]) == 0
    assert "== contract tests: none ran" in capsys.readouterr().out
    assert compat.main(["report", str(tmp_path / "missing.xml"), "--lock", str(lock)]) == 2
