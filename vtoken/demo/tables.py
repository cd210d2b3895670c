"""The demo's tables as plain HTML: every cell wraps, nothing is clipped or hidden behind a scroll bar, and on a
phone-width window each row becomes a card of "header: value" lines (`CSS`)."""

from __future__ import annotations

from html import escape
from typing import Any

CSS = """
.vtoken-table table { width: 100%; border-collapse: collapse; table-layout: auto; font-size: 0.9em; }
.vtoken-table th, .vtoken-table td { border: 1px solid var(--border-color-primary, #ddd); padding: 4px 6px;
  text-align: left; vertical-align: top; white-space: normal; overflow-wrap: break-word; }
.vtoken-table th { background: var(--background-fill-secondary, #f6f6f6); }
@media (max-width: 640px) {
  .vtoken-table thead { display: none; }
  .vtoken-table table, .vtoken-table tbody, .vtoken-table tr, .vtoken-table td { display: block; width: 100%; }
  .vtoken-table tr { border: 1px solid var(--border-color-primary, #ddd); margin-bottom: 8px; }
  .vtoken-table td { border: none; border-bottom: 1px dotted var(--border-color-primary, #ddd);
    overflow-wrap: anywhere; }
  .vtoken-table td::before { content: attr(data-label) ": "; font-weight: 600; }
}
"""


def html_table(headers: list[str], rows: list[list[Any]], caption: str = "") -> str:
    """An HTML table of `rows` under `headers` (escaped), each cell labelled with its header for the phone view."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td data-label="{escape(str(h))}">{escape(str(v))}</td>' for h, v in zip(headers, row,
                                                                                                   strict=True))
        + "</tr>"
        for row in rows
    )  # fmt: skip
    title = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f'<div class="vtoken-table"><table>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
