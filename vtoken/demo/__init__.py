"""The Gradio demo (`vtoken demo`, needs `pip install vtoken[demo]`): several configurations side by side against
the unpatched model, what each kept, time to first token, and a budget sweep on vtoken-mini.

`runs` computes (no UI), `views` draws what was kept, `app` is the Gradio page.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """`python -m vtoken.demo` / `python demo/app.py`: parse the options and serve the page."""
    from .app import main as app_main

    app_main(argv)


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on `parser` (`vtoken demo` and `python -m vtoken.demo` share them). Light: `vtoken
    --help` builds them without importing torch."""
    parser.add_argument("--model", default="vtoken-mini",
                        help="a built-in model (vtoken-mini, tiny-llava, ...: see `vtoken list`) or a checkpoint "
                             "directory")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also serve through a public Gradio share link")
