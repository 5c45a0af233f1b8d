"""The outcome of every GPU-marked test, wherever it lives, and the figures the tests record.

With ``JGS_GPU_RESULTS=FILE`` set, the session's end writes them to that JSON file together
with the device, driver and date, so that a GPU run's results can be committed as they came.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest

RESULTS: dict[str, Any] = {"tests": {}, "figures": {}}
# The name of the user property that carries a test's figures in its reports.
FIGURES = "gpu_figures"


def record(report: pytest.TestReport) -> None:
    """Called by the tests' conftest for each phase of each test, in the process that reports
    them (pytest-xdist's controller in a parallel run); keeps GPU tests only."""
    if "gpu" not in report.keywords:
        return
    nodeid = _without_group(report.nodeid)
    for name, value in report.user_properties:
        if name == FIGURES and report.when == "teardown":
            RESULTS["figures"][nodeid.rsplit("::", 1)[-1]] = value
    entry = RESULTS["tests"].setdefault(nodeid, {"outcome": "passed", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.failed:
        entry["outcome"] = "failed"
        entry["error"] = str(report.longrepr)[-1500:]
    elif report.skipped and report.when == "setup":
        entry["outcome"] = "skipped"


def _without_group(nodeid: str) -> str:
    """The test's id without the "@group" that ``--dist loadgroup`` appends to it (an "@" in
    a parameter's id, inside the brackets, is no group)."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


def write() -> None:
    """Called by the tests' conftest when the session ends."""
    path = os.environ.get("JGS_GPU_RESULTS")
    if not path or not RESULTS["tests"]:
        return
    from jupyter_gpu_snapshot.gpu.driver import load_driver
    from jupyter_gpu_snapshot.gpu.inventory import read_inventory

    inventory = read_inventory()
    status = load_driver()
    RESULTS.update(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        device=[d.name for d in inventory.devices] if inventory else [],
        driver=inventory.driver_version if inventory else "",
        cuda_driver_version=status.info.cuda_version if status.info else None,
        linux=platform.release(),
    )
    Path(path).write_text(json.dumps(RESULTS, indent=2, sort_keys=True))
