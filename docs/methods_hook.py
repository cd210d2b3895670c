"""MkDocs hook: the API reference lists every built-in method, as the registry finds them (`vtoken/methods/`), so a
new method file appears there without a docs edit. A page writes `<!-- every built-in method -->` where the list
goes."""

from __future__ import annotations

MARK = "<!-- every built-in method -->"


def on_page_markdown(markdown: str, **kwargs) -> str:
    if MARK not in markdown:
        return markdown
    from vtoken.methods import builtin_methods

    entries = [f"::: {cls.__module__}.{cls.__qualname__}" for cls in builtin_methods().values()]
    return markdown.replace(MARK, "\n\n".join(entries))
