"""What both benchmarks do between timed runs."""

from __future__ import annotations

import contextlib
import os
import platform
from datetime import datetime, timezone
from typing import Any


def settle(cold: bool = False) -> None:
    """Write back dirty pages, so no run pays for the previous run's image; before restores
    also drop the page cache, as after a reboot. Called outside the timed region."""
    os.sync()
    if cold:
        # Not root: caches stay warm, for both sides alike.
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


def host_facts() -> dict[str, Any]:
    """The machine a benchmark ran on, and when: the start of every result file."""
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / (1 << 20), 1),
        "linux": platform.release(),
        "python": platform.python_version(),
    }
