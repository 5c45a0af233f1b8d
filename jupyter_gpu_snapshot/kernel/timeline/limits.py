"""The timeline's limits and switch, from the kernel's environment."""

from __future__ import annotations

import os

from ..._constants import TIMELINE_ENV, TIMELINE_OFF_WORDS

ENV_TIMELINE = TIMELINE_ENV
ENV_LIMIT_BYTES = "JUPYTER_GPU_SNAPSHOT_TIMELINE_BYTES"
ENV_MAX_POINTS = "JUPYTER_GPU_SNAPSHOT_TIMELINE_POINTS"
ENV_GPU_COPIES = "JUPYTER_GPU_SNAPSHOT_TIMELINE_GPU"
# What a kernel without a timeline answers (the magic, REST and the CLI say it as it is).
TIMELINE_OFF = TIMELINE_OFF_WORDS
DEFAULT_MAX_POINTS = 100
# The copies live in the kernel's own memory, so every process snapshot of the kernel carries
# them: by default they take an eighth of the machine's memory, at most 2 GiB.
_DEFAULT_CAP_BYTES = 2 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def default_limit_bytes() -> int:
    """An eighth of the machine's memory, at most 2 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 30
    return min(total // 8, _DEFAULT_CAP_BYTES)


def parse_bytes(text: str) -> int:
    """``2G``, ``512MiB``, ``1000000``: a number of bytes."""
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    number = cleaned.rstrip("kmgt")
    return int(float(number) * _UNITS[cleaned[len(number):]])


def limits_from_env(env: dict[str, str] | None = None) -> tuple[int, int]:
    """The timeline's memory limit and its number of points, from the environment."""
    env = dict(os.environ) if env is None else env
    limit = default_limit_bytes()
    points = DEFAULT_MAX_POINTS
    if env.get(ENV_LIMIT_BYTES):
        limit = parse_bytes(env[ENV_LIMIT_BYTES])
    if env.get(ENV_MAX_POINTS):
        points = max(1, int(env[ENV_MAX_POINTS]))
    return limit, points


def enabled_by_env(env: dict[str, str] | None = None) -> bool:
    """Whether the kernel starts with a timeline: only when asked (``on``). Off by default,
    because what it keeps stays in the kernel's memory: a name deleted still holds its value
    for a rewind, and every process snapshot carries the copies."""
    value = (os.environ if env is None else env).get(ENV_TIMELINE, "off")
    return value.strip().lower() in ("on", "1", "true", "yes")


def gpu_copies_by_env(env: dict[str, str] | None = None) -> bool:
    """Whether values on a GPU are copied there. Off unless asked: a copy holds GPU memory
    the user's cells may need, and goes into every process snapshot the kernel's CUDA
    checkpoint writes."""
    value = (os.environ if env is None else env).get(ENV_GPU_COPIES, "off")
    return value.strip().lower() in ("on", "1", "true", "yes")
