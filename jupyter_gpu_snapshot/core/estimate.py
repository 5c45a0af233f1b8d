"""How long a save of a kernel will take, from its size and the rates of this machine.

A save moves the kernel's GPU memory to the host (the driver's checkpoint), then criu
writes host memory and the staged GPU memory to the image, then the commit hashes and
fsyncs it. So the model is::

    seconds = fixed + gpu_bytes / gpu_rate + (host_bytes + gpu_bytes) / image_rate

with ``image_rate`` the rate of the rest of a save (the dump, the commit and the checks
around them). The defaults are the figures measured on the H100 and H200 machines
(DESIGN.md): checkpoint 1.45 GB/s, criu dump 1.1 GB/s, commit about 1.74 GB/s. Past saves
on this machine replace them, the kernel's own first: their manifests keep the bytes and
the timings of each stage.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GB = 1e9
DEFAULT_GPU_RATE = 1.45 * GB
DEFAULT_IMAGE_RATE = 1 / (1 / (1.1 * GB) + 1 / (1.74 * GB))
DEFAULT_FIXED_SECONDS = 1.5
# Below this, fixed costs drown the rate: such saves teach only the fixed part.
LEARN_MIN_BYTES = 256 << 20
# The newest saves describe the machine as it is now.
LEARN_FROM_NEWEST = 20


@dataclass(frozen=True)
class SaveRates:
    """Bytes per second of each stage, and the seconds every save costs regardless."""

    gpu_rate: float = DEFAULT_GPU_RATE
    image_rate: float = DEFAULT_IMAGE_RATE
    fixed_seconds: float = DEFAULT_FIXED_SECONDS
    learned_from: int = 0

    def seconds(self, host_bytes: int, gpu_bytes: int) -> float:
        return (
            self.fixed_seconds
            + gpu_bytes / self.gpu_rate
            + (host_bytes + gpu_bytes) / self.image_rate
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "gpu_rate": self.gpu_rate,
            "image_rate": self.image_rate,
            "fixed_seconds": self.fixed_seconds,
            "learned_from": self.learned_from,
        }


def learn_rates(
    summaries: Iterable[Mapping[str, Any]], defaults: SaveRates | None = None
) -> SaveRates:
    """Rates measured by this machine's past saves (snapshot summaries), else ``defaults``.

    Each rate is the median over the newest saves large enough to measure it; a rate with
    no such save keeps its default. The image rate is a whole save's: every step but the
    GPU's checkpoint counts (the dump, the commit's digests and page lookups, the checks
    before and after), since a shutdown waits for all of them.
    """
    defaults = defaults or SaveRates()
    newest = sorted(summaries, key=lambda s: float(s.get("created", 0)))[-LEARN_FROM_NEWEST:]
    gpu_rates: list[float] = []
    for s in newest:
        t = s.get("timings") or {}
        moved = int((s.get("gpu") or {}).get("moved_bytes") or 0)
        suspend = float(t.get("suspend", 0.0))
        if moved >= LEARN_MIN_BYTES and suspend > 0 and _made_here(t):
            gpu_rates.append(moved / suspend)
    gpu_rate = statistics.median(gpu_rates) if gpu_rates else defaults.gpu_rate
    image_rates: list[float] = []
    fixed: list[float] = []
    for s in newest:
        t = s.get("timings") or {}
        if not _made_here(t):
            continue  # not a save made by this engine
        size = int(s.get("size_bytes", 0))
        total = float(t["total"])
        moved = int((s.get("gpu") or {}).get("moved_bytes") or 0)
        if size < LEARN_MIN_BYTES:
            fixed.append(total)
            continue
        rest = total - moved / gpu_rate
        if rest > 0:
            image_rates.append(size / rest)
    if not (image_rates or gpu_rates or fixed):
        return defaults
    return SaveRates(
        gpu_rate=gpu_rate,
        image_rate=statistics.median(image_rates) if image_rates else defaults.image_rate,
        fixed_seconds=statistics.median(fixed) if fixed else defaults.fixed_seconds,
        learned_from=len(image_rates) + len(gpu_rates) + len(fixed),
    )


def _made_here(timings: Mapping[str, Any]) -> bool:
    """Whether a save's timings are this engine's (a total, a dump and a commit)."""
    return all(float(timings.get(k, 0.0) or 0.0) > 0 for k in ("total", "dump", "commit"))


def learn_kernel_rates(
    summaries: Iterable[Mapping[str, Any]], kernel_id: str | None, notebook: str | None,
    defaults: SaveRates | None = None,
) -> SaveRates:
    """The rates of one kernel's next save: measured by its own past saves (of the kernel,
    or of its notebook), where there are any, over those of the whole store."""
    every = list(summaries)
    store = learn_rates(every, defaults)
    own = [s for s in every
           if (kernel_id and (s.get("kernel") or {}).get("kernel_id") == kernel_id)
           or (notebook and s.get("notebook_path") == notebook)]
    return learn_rates(own, store) if own else store


@dataclass(frozen=True)
class KernelToSave:
    """One kernel as the shutdown sees it: its size, and the work a lost save would cost."""

    kernel_id: str
    host_bytes: int
    gpu_bytes: int
    # Seconds of activity since the kernel's newest snapshot (0: nothing would be lost).
    work_at_risk: float
    newest_snapshot: str | None = None

    def seconds(self, rates: SaveRates) -> float:
        return rates.seconds(self.host_bytes, self.gpu_bytes)


def shutdown_order(kernels: Iterable[KernelToSave]) -> list[KernelToSave]:
    """Most work at risk first; among equals, the quickest save first."""
    return sorted(kernels, key=lambda k: (-k.work_at_risk, k.host_bytes + k.gpu_bytes))
