"""The Gradio demo (`vtoken demo`, needs `pip install vtoken[demo]`): several configurations side by side against
the unpatched model, what each kept, time to first token, and a budget sweep on vtoken-mini.

`runs` computes (no UI), `views` draws what was kept, `app` is the Gradio page.
"""

from __future__ import annotations

from .arguments import demo_arguments

__all__ = ["demo_arguments", "main"]


def main(argv: list[str] | None = None) -> None:
    """`python -m vtoken.demo` / `python demo/app.py`: parse the options and serve the page."""
    from .app import main as app_main

    app_main(argv)
