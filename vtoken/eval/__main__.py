"""`python -m vtoken.eval --tasks-path`: print the task pack's directory (for lmms-eval's `--include_path`)."""

from __future__ import annotations

import argparse

from . import tasks_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vtoken.eval", description=__doc__)
    parser.add_argument("--tasks-path", action="store_true", help="print the task pack's directory")
    args = parser.parse_args(argv)
    if not args.tasks_path:
        parser.print_help()
        return 2
    print(tasks_path())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
