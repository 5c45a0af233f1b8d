"""Names shared by every side of the kernel boundary: environment variables, the kernel and
provisioner names, the API prefix, and how a byte count, a table and a fallback's report
read.

Only the standard library may be used here: snapshot-ready kernels import this module, and
so does ``launch/nsinit.py``'s parent. The TypeScript side reads these names from the
server (``GET gpu-snapshot/info``), never from a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# What a snapshot-ready kernel learns from its environment about the server that owns it.
ENV_URL = "JUPYTER_GPU_SNAPSHOT_URL"
ENV_TOKEN = "JUPYTER_GPU_SNAPSHOT_TOKEN"
ENV_KERNEL_ID = "JUPYTER_GPU_SNAPSHOT_KERNEL_ID"
KERNEL_ENV_NAMES = (ENV_URL, ENV_TOKEN, ENV_KERNEL_ID)
# How a kernel's own credential in ENV_TOKEN begins (launch/kernel_token.py); the magic
# tells it from a server token an operator gave the kernels by it.
KERNEL_TOKEN_PREFIX = "gpusnap-kernel"

# Fallbacks of the c.GPUSnapshot settings that operators set without a config file.
ENV_STORE_DIR = "JUPYTER_GPU_SNAPSHOT_DIR"
ENV_CRIU = "JUPYTER_GPU_SNAPSHOT_CRIU"
ENV_REMOTE_URL = "JUPYTER_GPU_SNAPSHOT_REMOTE_URL"
ENV_REMOTE_KEY_FILE = "JUPYTER_GPU_SNAPSHOT_REMOTE_KEY_FILE"
ENV_SIGNING_KEY = "JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE"
ENV_GROW_GPU_ALLOCATORS = "JUPYTER_GPU_SNAPSHOT_GROW_GPU_ALLOCATORS"
ENV_CHUNK_IMAGES = "JUPYTER_GPU_SNAPSHOT_CHUNK_IMAGES"
ENV_LIBDIR = "JUPYTER_GPU_SNAPSHOT_LIBDIR"
# Where scripts/install-criu.sh puts CRIU's CUDA plugin and our cuda-checkpoint stand-in.
DEFAULT_LIBDIR = "/usr/local/lib/jupyter-gpu-snapshot"

# criu's environment during a save or restore of a CUDA kernel: where our cuda-checkpoint
# stand-in reaches the engine (gpu/broker.py, gpu/cuda_checkpoint_shim.c).
ENV_CUDA_BROKER = "JUPYTER_GPU_SNAPSHOT_CUDA_BROKER"

# What snapshot-ready kernels get (c.GPUSnapshot.grow_gpu_allocators) so that JAX's and
# TensorFlow's default allocators take GPU memory as arrays need it instead of most of the
# GPU at their first use; the driver's checkpoint copies every byte they hold.
GROWING_ALLOCATOR_ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "TF_FORCE_GPU_ALLOW_GROWTH": "true",
}

KERNEL_NAME = "python3-snapshot"
KERNEL_DISPLAY_NAME = "Python 3 (snapshots)"
PROVISIONER_NAME = "gpu-snapshot-provisioner"

# How launch/nsinit.py, the namespace's init, records in the kernel's log how the kernel
# ended: "nsinit: kernel ended: killed by signal 11 (SIGSEGV)". nsinit runs with the standard
# library alone and keeps its own copy of this string; tests/launch/test_provisioner.py holds
# them equal.
KERNEL_DEATH_PREFIX = "nsinit: kernel ended: "

# REST routes live under {base_url}gpu-snapshot/.
API_PREFIX = "gpu-snapshot"

# What a save asks a snapshot-ready kernel on its control channel (kernel/cell_record.py
# and kernel/portable_request.py answer, node/save_requests.py asks): the cells it ran,
# and its portable copy.
CELLS_REQUEST = "gpu_snapshot_cells_request"
CELLS_REPLY = "gpu_snapshot_cells_reply"
PORTABLE_REQUEST = "gpu_snapshot_portable_request"
PORTABLE_REPLY = "gpu_snapshot_portable_reply"
# A kernel's timeline (kernel/timeline/ answers; the server and the CLI ask): its points, one
# per cell, and a rewind to before one of them. See docs/rewind.md for the contents.
TIMELINE_REQUEST = "gpu_snapshot_timeline_request"
TIMELINE_REPLY = "gpu_snapshot_timeline_reply"
REWIND_REQUEST = "gpu_snapshot_rewind_request"
REWIND_REPLY = "gpu_snapshot_rewind_reply"
# ``on`` in a kernel's environment starts it with a timeline (c.GPUSnapshot.timeline sets it).
TIMELINE_ENV = "JUPYTER_GPU_SNAPSHOT_TIMELINE"
# What a kernel without a timeline answers a rewind, and how its timeline reads.
TIMELINE_OFF_WORDS = ("the timeline is off: turn it on with %gpu_snapshot timeline on, or for "
                      "every kernel with c.GPUSnapshot.timeline = True")
# The cells a snapshot keeps: the newest ones, up to this much source in all (the kernel
# sends no more, and a manifest accepts no more).
HISTORY_SOURCE_BYTES = 2 << 20

# The ways back when a snapshot's image cannot come back (node/fallback.py).
FALLBACK_MODES = ("portable", "replay", "both")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1.5 GiB``: binary units, one decimal, whole bytes below 1 KiB."""
    size = float(n)
    i = 0
    while size >= 1024 and i < len(_UNITS) - 1:
        size /= 1024
        i += 1
    return f"{int(size)} B" if i == 0 else f"{size:.1f} {_UNITS[i]}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows as aligned columns, the first row the header, the same in the magic and the CLI:
    no cell is ever cut or wrapped, so ids and paths copy whole (a terminal may fold a long
    line)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def fallback_report_lines(report: dict[str, Any]) -> list[str]:
    """A fallback's report (node/fallback.py) as lines a person reads, the same in the
    magic, the panel and the CLI: what came back, what did not and why, which cells were
    re-run and which failed."""
    lines = []
    loaded = report.get("loaded", [])
    if loaded:
        lines.append("Back: " + ", ".join(
            f"{entry['name']} ({entry.get('kind', '?')}"
            + (f" on {entry['device']}" if entry.get("device") not in (None, "", "cpu")
               else "") + ")"
            for entry in loaded))
        lines.extend(f"  {entry['name']}: {entry['note']}" for entry in loaded
                     if entry.get("note"))
    replayed = report.get("replayed", [])
    if replayed:
        failed = [entry for entry in replayed if entry.get("status") != "ok"]
        lines.append(f"Re-ran {len(replayed)} cell(s)"
                     + (f", {len(failed)} failed:" if failed else "."))
        lines.extend(f"  cell [{entry['count']}]: {entry.get('error')}" for entry in failed)
    for entry in report.get("not_loaded", []):
        lines.append(f"Not back: {entry['name']}: {entry['reason']}")
    lines.extend(report.get("notes", []))
    return lines or ["Nothing to bring back: the snapshot carried no names and no cells."]


def fallback_offer(name: str, offered: list[str]) -> str:
    """What to type when a snapshot's image cannot come back but its work can."""
    ways = " or ".join(f"--fallback {mode}" for mode in offered)
    return (f"Its work can still come back in a fresh kernel: %gpu_snapshot restore {name} "
            f"{ways}")


def _names_text(names: list[str], limit: int) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def timeline_lines(content: dict[str, Any],
                   rewind_hint: str = "%gpu_snapshot rewind N") -> list[str]:
    """A kernel's timeline (its timeline reply, see docs/rewind.md) as lines a person reads,
    the same in the magic and the CLI: the points oldest first, what each changed and could
    not keep, and the counts that can be rewound to (``rewind_hint`` says how)."""
    import time

    if content.get("on") is False:
        return [TIMELINE_OFF_WORDS]
    points = content.get("points") or []
    dropped = int(content.get("dropped") or 0)
    lines = [f"Timeline: {len(points)} point(s), {format_bytes(int(content.get('bytes', 0)))}"
             f" of {format_bytes(int(content.get('limit_bytes', 0)))}"
             + (f"; {dropped} older point(s) dropped for the limits" if dropped else "") + "."]
    rewindable = set(content.get("rewindable") or [])
    for point in points:
        when = time.strftime("%H:%M:%S", time.localtime(float(point.get("at", 0))))
        parts = []
        if point.get("changed"):
            parts.append("changed " + _names_text(point["changed"], 8))
        if point.get("deleted"):
            parts.append("deleted " + _names_text(point["deleted"], 8))
        what = "; ".join(parts) or "changed nothing the timeline sees"
        failed = "" if point.get("ok", True) else " (raised)"
        mark = "" if point["count"] in rewindable else " [cannot rewind to before it]"
        lines.append(f"  [{point['count']}]{failed} {when}, "
                     f"{format_bytes(int(point.get('bytes', 0)))}: {what}{mark}")
        lines.extend(f"      not kept: {item['name']}: {item['reason']}"
                     for item in point.get("uncopied") or [])
    if rewindable:
        lines.append(f"Rewind with {rewind_hint}, N one of: "
                     + ", ".join(str(count) for count in sorted(rewindable)) + ".")
    else:
        lines.append("Nothing can be rewound now.")
    return lines


def rewind_report_lines(report: dict[str, Any]) -> list[str]:
    """A rewind's report (docs/rewind.md) as lines a person reads, the same in the magic and
    the CLI: what came back, what could not and why, and the caveats."""
    undone = report.get("undone") or []
    lines = [f"Rewound to before cell [{report.get('before')}]: the effects of "
             f"{len(undone)} cell(s) are undone ("
             + ", ".join(f"[{count}]" for count in undone) + ")."]
    if report.get("restored"):
        lines.append("Put back as they were: " + _names_text(report["restored"], 20) + ".")
    if report.get("removed"):
        lines.append("Removed (they did not exist then): "
                     + _names_text(report["removed"], 20) + ".")
    if not report.get("restored") and not report.get("removed"):
        lines.append("No name needed to change.")
    lines.extend(f"Could not put back {item['name']}: {item['reason']}; it keeps its current "
                 "value." for item in report.get("not_restored") or [])
    lines.extend(f"Note: {caveat}." for caveat in report.get("caveats") or [])
    return lines
