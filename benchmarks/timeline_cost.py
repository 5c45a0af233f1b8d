"""The timeline's cost per cell, against the same cells with the timeline off, in one run.

One IPython shell in this process (the kernel's own shell class, without the messaging),
holding a namespace of a few hundred names: small values, small arrays, a pandas frame and
``--big-mib`` of NumPy arrays in three arrays. Two cells are timed, each ``--repeat`` times,
with the timeline's hooks registered and not, alternated (on, off, off, on, ...):

- ``unchanged``: a cell that changes nothing big (``step = step + 1``);
- ``update_256mib``: a cell that updates a 256 MiB NumPy array in place
  (``big_update += 1``), which the timeline digests and copies. Until the timeline's
  memory limit (``--limit-mib``) is reached, each copy takes fresh memory, whose first
  touch is what costs most on a virtual machine; after, the copies let go of lend theirs.

For each: the median seconds of ``run_cell`` on and off, their difference (the cost the
user sees), and the median of the timeline's own ``post_run_cell`` alone. Then the
rewind of the 256 MiB update by one cell, five times. The target of
issue 53 is at most 20 ms for the unchanged cell.

    python benchmarks/timeline_cost.py [--repeat 41] [--big-mib 300] [--limit-mib 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from IPython.core.interactiveshell import InteractiveShell

from jupyter_gpu_snapshot.kernel.timeline import Timeline

REPO = Path(__file__).resolve().parents[1]
CELLS = {"unchanged": "step = step + 1", "update_256mib": "big_update += 1"}


def build_namespace(shell: InteractiveShell, big_mib: int) -> None:
    shell.run_cell(
        f"""
import numpy as np, pandas as pd
step = 0
for _i in range(100):
    globals()[f"number_{{_i}}"] = _i
    globals()[f"text_{{_i}}"] = "value " * _i
    globals()[f"small_{{_i}}"] = np.arange(100 + _i, dtype=np.float64)
for _i in range(50):
    globals()[f"listed_{{_i}}"] = list(range(_i * 10))
    globals()[f"mapped_{{_i}}"] = {{str(_k): _k for _k in range(_i)}}
frame = pd.DataFrame({{"a": np.arange(1_000_000), "b": np.random.rand(1_000_000)}})
big = [np.ones(({big_mib} << 20) // 8 // 3) for _ in range(3)]
big_update = np.zeros((256 << 20) // 8)
""", store_history=True)


def timed(shell: InteractiveShell, code: str, timeline: Timeline | None,
          hook_seconds: list[float]) -> float:
    if timeline is not None:
        original = timeline.post_run_cell

        def measured(result: Any) -> None:
            started = time.perf_counter()
            original(result)
            hook_seconds.append(time.perf_counter() - started)

        shell.events.register("pre_run_cell", timeline.pre_run_cell)
        shell.events.register("post_run_cell", measured)
    started = time.perf_counter()
    result = shell.run_cell(code, store_history=True)
    seconds = time.perf_counter() - started
    if timeline is not None:
        shell.events.unregister("pre_run_cell", timeline.pre_run_cell)
        shell.events.unregister("post_run_cell", measured)
    if not result.success:
        raise RuntimeError(f"the cell {code!r} failed: {result.error_in_exec}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=41)
    parser.add_argument("--big-mib", type=int, default=300)
    parser.add_argument("--limit-mib", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    build_namespace(shell, args.big_mib)
    names = [name for name in shell.user_ns if not name.startswith("_")]
    timeline = Timeline(shell, args.limit_mib << 20, 100)
    cases: dict[str, Any] = {}
    for case, code in CELLS.items():
        on: list[float] = []
        off: list[float] = []
        hook: list[float] = []
        timed(shell, code, timeline, [])  # the first point copies what is new
        for index in range(args.repeat):
            order = (True, False) if index % 2 == 0 else (False, True)
            for with_timeline in order:
                if with_timeline:
                    on.append(timed(shell, code, timeline, hook))
                else:
                    off.append(timed(shell, code, None, []))
        cases[case] = {
            "cell": code, "runs": args.repeat,
            "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
            "cost_median_ms": (statistics.median(on) - statistics.median(off)) * 1000,
            # The machine is shared: the least of each is the cost without the others'
            # load, the medians with it.
            "cost_min_ms": (min(on) - min(off)) * 1000,
            "post_run_cell_median_ms": statistics.median(hook) * 1000,
            "post_run_cell_min_ms": min(hook) * 1000,
            "post_run_cell_max_ms": max(hook) * 1000,
            "on_s": on, "off_s": off,
        }
        print(f"{case}: on {statistics.median(on) * 1000:.1f} ms, off "
              f"{statistics.median(off) * 1000:.1f} ms, timeline hook "
              f"{statistics.median(hook) * 1000:.1f} ms (median of {args.repeat})",
              flush=True)
    # A rewind by one cell of the 256 MiB update: the array's data written back into it.
    rewinds: list[float] = []
    for _ in range(5):
        timed(shell, CELLS["update_256mib"], timeline, [])
        before = timeline.points[-1].count
        started = time.perf_counter()
        report = timeline.rewind(before)
        rewinds.append(time.perf_counter() - started)
        if report["restored"] != ["big_update"]:
            raise RuntimeError(f"the rewind put back {report['restored']}")
    print(f"rewind by one cell (256 MiB in place): {statistics.median(rewinds) * 1000:.1f} ms",
          flush=True)
    content = timeline.content()
    result = {
        "benchmark": "timeline_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count(), "processor": platform.processor(),
                    "numpy": np.__version__, "pandas": pd.__version__,
                    # The machine is shared: its load at the end says how noisy this was.
                    "load_average": list(os.getloadavg())},
        "namespace": {"names": len(names), "big_numpy_mib": args.big_mib,
                      "update_array_mib": 256},
        "timeline": {"limit_bytes": content["limit_bytes"], "bytes": content["bytes"],
                     "points": len(content["points"]), "dropped": content["dropped"]},
        "target_unchanged_ms": 20,
        "cases": cases,
        "rewind_one_cell_256mib": {"runs": len(rewinds),
                                   "median_ms": statistics.median(rewinds) * 1000,
                                   "min_ms": min(rewinds) * 1000},
    }
    out = args.out or REPO / "benchmarks" / "results" / \
        f"timeline-cost-cpu-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
