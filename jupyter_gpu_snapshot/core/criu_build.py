"""Which criu ``scripts/install-criu.sh`` installed, read from the note it leaves beside
CRIU's CUDA plugin (``built-for``): its version, whether it fills restored memory on
several CPUs (our patches, ``scripts/criu-patches``) and, when not, why not.

The product never depends on the patches: a stock criu restores the same snapshots, only
slower. ``jupyter gpu-snapshot check`` and the server's kernel status say which it is.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

# How much longer a restore takes with stock criu: the 8B shape's warm restore by content,
# a stock build of the same source against the series, on one H100 (docs/performance.md,
# "Stock criu, the previous patch and the series"; 19.16 s against 8.38 s; cold, 1.46x).
# The one copy of it in the code.
SLOWER_WITHOUT_FAST_FILL = 2.3


@dataclass(frozen=True)
class CriuBuild:
    """A criu as the install's note describes it."""

    version: str  # "4.2.1"
    patches: str | None  # the sum of the series applied; None: stock criu
    why_stock: str  # why the patches are not in it ("" when they are)
    source: str  # "criu_4.2.1.orig.tar.xz sha256 ..." ("" in notes of older installs)
    criu_sha256: str | None  # of the criu binary installed ("" in older notes)

    @property
    def fast_fill(self) -> bool:
        return self.patches is not None


def parse_note(text: str) -> CriuBuild | None:
    """The note's fields; None when it is not one (empty, or no version line).

    Its first line is criu's version line and what was applied: "Version: 4.2.1 patches
    f2bb4ace75b1a30f" or "Version: 4.3 stock"; the others are "key: value". Notes of
    older installs have the first line alone, and those criu were always patched.
    """
    lines = text.strip().splitlines()
    if not lines or not lines[0].startswith("Version:"):
        return None
    words = lines[0].removeprefix("Version:").split()
    if not words:
        return None
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    patches = words[2] if len(words) >= 3 and words[1] == "patches" else None
    return CriuBuild(
        version=words[0],
        patches=patches,
        why_stock="" if patches else fields.get("why", "installed without our patches"),
        source=fields.get("source", ""),
        criu_sha256=fields.get("criu-sha256") or None,
    )


def read_note(plugin_dir: Path) -> CriuBuild | None:
    """The note in ``plugin_dir`` (``<libdir>/criu``); None when there is none."""
    try:
        return parse_note((plugin_dir / "built-for").read_text())
    except OSError:
        return None


_digests: dict[tuple[str, int, int], str] = {}
_digests_lock = threading.Lock()


def _digest(path: Path) -> str:
    """sha256 of the file at ``path``, remembered while its size and mtime stay."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _digests_lock:
        known = _digests.get(key)
    if known is None:
        known = hashlib.sha256(path.read_bytes()).hexdigest()
        with _digests_lock:
            _digests[key] = known
    return known


@dataclass(frozen=True)
class CriuFill:
    """How this node's criu fills a restored kernel's memory, as the check and the status
    say it. ``fast``: None when it cannot be told (a criu the install did not build)."""

    version: str | None
    fast: bool | None
    detail: str

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "fast_fill": self.fast, "detail": self.detail}


def describe_fill(criu_executable: Path, plugin_dir: Path) -> CriuFill:
    """Which criu ``criu_executable`` is, from the install's note in ``plugin_dir``.

    Called by ``node.checks`` and by the node's engine for the server's kernel status.
    Blocks (reads the criu binary once): call it from a worker thread.
    """
    build = read_note(plugin_dir)
    if build is None:
        return CriuFill(None, None, f"{criu_executable} was not installed by "
                        "scripts/install-criu.sh: whether it fills memory on several CPUs is "
                        "unknown")
    try:
        same = build.criu_sha256 is None or _digest(criu_executable) == build.criu_sha256
    except OSError:
        same = False
    if not same:
        return CriuFill(None, None, f"{criu_executable} is not the criu that "
                        f"scripts/install-criu.sh built ({plugin_dir / 'built-for'} describes "
                        "another): whether it fills memory on several CPUs is unknown")
    if build.fast_fill:
        return CriuFill(build.version, True, f"criu {build.version} with our patches: "
                        "restored memory is filled on several CPUs")
    return CriuFill(build.version, False, f"stock criu {build.version}: restored memory is "
                    f"filled on one thread, so restores of large kernels take about "
                    f"{SLOWER_WITHOUT_FAST_FILL}x as long; {build.why_stock}")
