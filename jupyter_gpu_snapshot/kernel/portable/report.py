"""What a portable copy's directory holds besides its data: the names of its files, its
report, and the reasons a name is not carried or not loaded, as the report gives them.

``write`` writes the report last (``portable.report.json``: its presence means the copy is
complete), ``load`` reads it back (``read_report``); the server keeps it in the snapshot's
signed manifest and hands it to the loading kernel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPORT_FILE = "portable.report.json"
REPORT_FORMAT = 1
# Every file of a copy is named ``portable.*`` and matches this.
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REASON_CHARS = 300


class PortableCopyAbandoned(Exception):
    """Writing stopped because ``should_stop`` said so (the user interrupted)."""


class NotPortable(Exception):
    """An object that a copy cannot carry, with the reason a person reads."""


class TensorUnavailable(Exception):
    """A tensor of the copy that cannot be loaded here (a dtype without its library)."""


def reason(exc: BaseException) -> str:
    """Why a name was not carried or not loaded, as the report says it: short."""
    if isinstance(exc, (NotPortable, TensorUnavailable)):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def read_report(directory: Path, report: str | None = None) -> dict[str, Any]:
    """A copy's report: ``report`` as JSON text or a file's path, else the one in
    ``directory``."""
    if report is None:
        text = (Path(directory) / REPORT_FILE).read_text()
    elif report.lstrip().startswith("{"):
        text = report
    else:
        text = Path(report).read_text()
    parsed = json.loads(text)
    if not isinstance(parsed, dict):
        raise ValueError("a portable copy's report is a JSON object")
    return parsed
