"""The demo's command-line options (`vtoken demo` and `python -m vtoken.demo` share them). Light: `vtoken --help`
builds them without importing torch or Gradio."""

from __future__ import annotations

import argparse


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on `parser`."""
    parser.add_argument("--model", default="vtoken-mini",
                        help="a built-in model (vtoken-mini, tiny-llava, ...: see `vtoken list`) or a checkpoint "
                             "directory")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also serve through a public Gradio share link")
