"""Notebook 02's training survives a hard kill through its autosave, on the GPU machine.

A short run of ``benchmarks/bench_autosave.py`` (the measured one runs minutes): real
server, real autosaves that pause the running training cell, SIGKILL of the server and the
kernel, restore of the newest autosave in a new server, and the restored run's losses
compared bit for bit with those the killed run had for the same steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).parents[2]
BENCH = REPO / "benchmarks" / "bench_autosave.py"


@pytest.mark.timeout(900)
def test_training_survives_a_hard_kill_through_its_autosave(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    out = tmp_path / "autosave.json"
    # The benchmark imports the shared test kit (testkit/processes.py) from the checkout.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(BENCH), "--minutes", "1", "--interval", "0.25",
         "--continue-steps", "500", "--out", str(out)],
        cwd=BENCH.parent, env=dict(os.environ, PYTHONPATH=path), capture_output=True,
        text=True, timeout=840,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    figures.update(summary)
    assert summary["autosaves"] >= 2, summary
    assert summary["losses_continue_bitwise"] is True, summary
    assert summary["hard_kill_lost_within_one_interval"] is True, summary
    assert summary["hard_kill_lost_steps"] > 0, summary
