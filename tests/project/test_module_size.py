"""No Python module of the package is over 700 lines: past that, a module holds more than one
thing (a module that passes about 400 lines asks whether it does already), and is split by
what it does, as ``kernel/portable/`` and ``server/hibernation/`` were."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "jupyter_gpu_snapshot"
MOST_LINES = 700


def test_no_module_is_over_700_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no module found under {PACKAGE}"
    long = {str(path.relative_to(PACKAGE)): lines for path in modules
            if (lines := len(path.read_text().splitlines())) > MOST_LINES}
    assert not long, f"modules over {MOST_LINES} lines: {long}"
