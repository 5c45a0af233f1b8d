"""What both benchmarks do between timed runs."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from jupyter_gpu_snapshot.core.criu import CriuRunner
from testkit.criu_wrappers import install, keeps_the_restore_log


@contextlib.contextmanager
def fill_workers_set(workers: int | None) -> Iterator[None]:
    """criu's ``--fill-workers`` (scripts/criu-patches) for the restores inside, when given:
    a configuration file of criu's, which criu reads beside its command line where
    ``CRIU_CONFIG_FILE`` names one. Only for a criu with the option: criu refuses a file
    with an option it does not know."""
    if workers is None:
        yield
        return
    before = os.environ.get("CRIU_CONFIG_FILE")
    with tempfile.NamedTemporaryFile("w", prefix="criu-fill-", suffix=".conf") as conf:
        conf.write(f"fill-workers {workers}\n")
        conf.flush()
        os.environ["CRIU_CONFIG_FILE"] = conf.name
        try:
            yield
        finally:
            if before is None:
                del os.environ["CRIU_CONFIG_FILE"]
            else:
                os.environ["CRIU_CONFIG_FILE"] = before


# What criu's log says about how it filled the memory (scripts/criu-patches): the bytes
# its fill workers read, in place or from an image file, on how many; whether the image
# streamer handed a pages image over in place, or sent it through a pipe, and why; and
# the lines of the previous patch (one parallel-page-fill.patch), for comparisons.
_FILL_LINE = re.compile(
    r"^\(\s*[\d.]+\)\s*(.*(?:Read \d+ bytes of pages|The streamer (?:hands|sends)|"
    r"place of .* is malformed|nr_shared_pages|(?:Reading|Populating) \d+ bytes|"
    r"not read in place).*)$",
    re.MULTILINE)


class CriuWithRestoreLog:
    """A criu (the one on PATH, or ``criu``), whose restore log is kept after each
    restore, so a benchmark records how criu filled the memory: read in place, read from
    the image files, or through the stream's pipe."""

    def __init__(self, directory: Path, criu: str | None = None, name: str = "criu-wrapper"
                 ) -> None:
        self.log = directory / f"{name}-restore.log"
        self.runner = CriuRunner(install(directory, keeps_the_restore_log(self.log, real=criu),
                                         name=name))

    def fill_lines(self) -> list[str]:
        """The last restore's fill lines; the log is removed, so each restore has its own."""
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        self.log.unlink()
        return _FILL_LINE.findall(text)


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


def read_rate(paths: list[Path], cold: bool) -> dict[str, float]:
    """Bytes per second of reading ``paths`` in order, 16 MiB at a time, one thread: the
    store's sequential read, from the disk (``cold``: caches dropped first) or the page
    cache."""
    settle(cold=cold)
    total = 0
    started = time.monotonic()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 16 << 20):
                total += len(chunk)
        finally:
            os.close(fd)
    seconds = time.monotonic() - started
    return {"bytes": total, "seconds": round(seconds, 3),
            "bytes_per_s": round(total / seconds) if seconds else 0}


def population_rate(huge: bool, size: int = 4 << 30) -> dict[str, float]:
    """Bytes per second of first-touching fresh anonymous memory, one thread, with 4 KiB
    pages or transparent huge pages asked for (``MADV_HUGEPAGE``): what filling a restored
    process's memory costs before any byte is copied."""
    area = mmap.mmap(-1, size)
    try:
        if huge:
            area.madvise(mmap.MADV_HUGEPAGE)
        pages = np.frombuffer(area, np.uint8)
        started = time.monotonic()
        pages[::4096] = 1
        seconds = time.monotonic() - started
        del pages
    finally:
        area.close()
    return {"bytes": size, "seconds": round(seconds, 3), "bytes_per_s": round(size / seconds)}


MADV_POPULATE_WRITE = 23  # Linux 5.14


def parallel_population_rate(threads: int, size: int = 8 << 30) -> dict[str, float]:
    """Bytes per second of populating fresh anonymous memory on ``threads`` threads at once,
    each a part of one mapping: what criu's fill workers (scripts/criu-patches) can reach."""
    area = mmap.mmap(-1, size)
    view = (ctypes.c_char * size).from_buffer(area)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base, part = ctypes.addressof(view), size // threads

        def populate(i: int) -> None:
            if libc.madvise(base + i * part, part, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

        with ThreadPoolExecutor(threads) as pool:
            started = time.monotonic()
            list(pool.map(populate, range(threads)))
            seconds = time.monotonic() - started
    finally:
        del view
        area.close()
    return {"bytes": size, "threads": threads, "seconds": round(seconds, 3),
            "bytes_per_s": round(size / seconds)}


def copy_rate(size: int = 4 << 30) -> dict[str, float]:
    """Bytes per second of one memcpy between two populated buffers, one thread."""
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    started = time.monotonic()
    np.copyto(dst, src)
    seconds = time.monotonic() - started
    return {"bytes": size, "seconds": round(seconds, 3), "bytes_per_s": round(size / seconds)}


def machine_floors(store_files: list[Path]) -> dict[str, Any]:
    """The machine's own limits, measured in the run they are compared with."""
    return {
        "store_read_cold": read_rate(store_files, cold=True),
        "store_read_warm": read_rate(store_files, cold=False),
        "populate_4k": population_rate(huge=False),
        "populate_thp": population_rate(huge=True),
        "populate_8_threads": parallel_population_rate(8),
        "memcpy": copy_rate(),
        "thp_setting": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
    }
