"""The timeline's limits and switch, from the kernel's environment."""

from __future__ import annotations

import os

ENV_TIMELINE = "JUPYTER_GPU_SNAPSHOT_TIMELINE"
ENV_LIMIT_BYTES = "JUPYTER_GPU_SNAPSHOT_TIMELINE_BYTES"
ENV_MAX_POINTS = "JUPYTER_GPU_SNAPSHOT_TIMELINE_POINTS"
DEFAULT_MAX_POINTS = 100
_DEFAULT_CAP_BYTES = 8 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def default_limit_bytes() -> int:
    """A quarter of the machine's memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 30
    return min(total // 4, _DEFAULT_CAP_BYTES)


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
    value = (os.environ if env is None else env).get(ENV_TIMELINE, "on")
    return value.strip().lower() not in ("off", "0", "false", "no")
