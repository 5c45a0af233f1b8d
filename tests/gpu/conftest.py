"""GPU tests: skipped, with the reason shown, only where no NVIDIA driver exists.

On a machine with a driver they run; anything missing there is a failure, not a skip. Set
``JGS_GPU_RESULTS=FILE`` to write every GPU test's outcome and the figures the tests record
(device, driver, date, times, image sizes) to a JSON file.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..gpu_check import no_gpu_reason

RESULTS: dict[str, Any] = {"tests": {}, "figures": {}}




def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "gpu" not in report.keywords:
        return
    entry = RESULTS["tests"].setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.failed:
        entry["outcome"] = "failed"
        entry["error"] = str(report.longrepr)[-1500:]
    elif report.skipped and report.when == "setup":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session: pytest.Session) -> None:
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


@pytest.fixture(autouse=True)
def _drop_images(store: Any) -> Iterator[None]:
    """GPU images are gigabytes: remove each test's store when it ends (the disk is small)."""
    yield
    shutil.rmtree(store.root, ignore_errors=True)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Numbers a GPU test measured, kept in the results file under the test's name."""
    found: dict[str, Any] = {}
    yield found
    if found:
        RESULTS["figures"][request.node.name] = found
