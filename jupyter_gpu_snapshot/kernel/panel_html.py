"""What the snapshots panel (``widget``) shows as HTML: a snapshot of its list, the report
of a way back into a fresh kernel, and the ways back as its buttons name them."""

from __future__ import annotations

import html
from typing import Any

from .._constants import FALLBACK_MODES
from .presentation import format_age, snapshot_size_text

Json = dict[str, Any]

# The ways back into a fresh kernel, as the buttons say them, and what each keeps.
FALLBACK_LABELS = {
    "portable": "Load the portable copy",
    "replay": "Re-run the cells",
    "both": "Both",
}
FALLBACK_EXPLANATIONS = {
    "portable": "loads the variables the snapshot copied (tensors, arrays and what dill "
    "could save); no cell runs, and what could not be copied is missing",
    "replay": "runs again the cells the kernel ran, in order: all they built comes back, "
    "in the time they take",
    "both": "loads the portable copy, then re-runs only the cells that built the names it "
    "lacks",
}


def offered_fallbacks(listed: Any) -> list[str]:
    """The known ways back of a server's list, in offering order (the fullest last)."""
    if not isinstance(listed, list):
        return []
    return [mode for mode in FALLBACK_MODES if mode in listed]


def html_text(value: str, color: str | None = None) -> str:
    """``value`` as HTML, in ``color`` if given."""
    style = f' style="color:{color}"' if color else ""
    return f"<span{style}>{html.escape(value)}</span>"


def snapshot_html(summary: Json, now: float) -> str:
    """One snapshot of the list: its name, age, size, what it keeps besides its image,
    and its id."""
    created = float(summary.get("created", 0))
    offered = offered_fallbacks(summary.get("fallback"))
    keeps = (
        "portable copy &middot; " if "portable" in offered
        else "cells recorded &middot; " if offered else ""
    )
    return (
        f"<b>{html.escape(str(summary.get('name')))}</b> &nbsp;"
        f"{html.escape(format_age(now - created))} &middot; "
        f"{html.escape(snapshot_size_text(summary))} &middot; {keeps}"
        f"<code>{html.escape(str(summary.get('id')))}</code>"
    )


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def report_summary(report: Json) -> str:
    """A way back's report in a line: "2 names loaded, 1 not; 3 cells re-run, 1 failed"."""
    loaded = len(report.get("loaded") or [])
    missing = len(report.get("not_loaded") or [])
    replayed = list(report.get("replayed") or [])
    failed = sum(1 for cell in replayed if cell.get("status") != "ok")
    mode = report.get("mode")
    parts = []
    if loaded or missing or mode != "replay":
        text = _plural(loaded, "name loaded", "names loaded")
        parts.append(f"{text}, {missing} not" if missing else text)
    if replayed or mode != "portable":
        text = _plural(len(replayed), "cell re-run", "cells re-run")
        parts.append(f"{text}, {failed} failed" if failed else text)
    return "; ".join(parts)


def report_html(report: Json) -> str:
    """What came back and where, what did not and why, each cell re-run, and the notes."""
    esc = html.escape
    sections = [f"<b>{esc(report_summary(report))}</b>"]

    def listing(title: str, items: list[str]) -> None:
        if items:
            sections.append(
                f"{esc(title)}:<ul>{''.join(f'<li>{item}</li>' for item in items)}</ul>")

    listing("Came back", [
        f"<code>{esc(str(item.get('name')))}</code> ({esc(str(item.get('kind')))}, on "
        f"{esc(str(item.get('device')))})"
        + (f": {esc(str(item['note']))}" if item.get("note") else "")
        for item in report.get("loaded") or []
    ])
    listing("Did not come back", [
        f"<code>{esc(str(item.get('name')))}</code>: {esc(str(item.get('reason')))}"
        for item in report.get("not_loaded") or []
    ])
    listing("Cells re-run", [
        f"In [{esc(str(cell.get('count')))}]: ran" if cell.get("status") == "ok"
        else html_text(f"In [{cell.get('count')}]: failed: "
                   f"{cell.get('error') or 'no reason given'}", "#c62828")
        for cell in report.get("replayed") or []
    ])
    listing("Notes", [esc(str(note)) for note in report.get("notes") or []])
    return "".join(sections)
