"""What both benchmarks do between timed runs."""

from __future__ import annotations

import contextlib
import os


def settle(cold: bool = False) -> None:
    """Write back dirty pages, so no run pays for the previous run's image; before restores
    also drop the page cache, as after a reboot. Called outside the timed region."""
    os.sync()
    if cold:
        # Not root: caches stay warm, for both sides alike.
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
