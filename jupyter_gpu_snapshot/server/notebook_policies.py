"""The notebooks' own choices over the server's autosave and hibernation settings.

A notebook may override the settings (``PUT kernels/{id}/autosave``, ``%gpu_snapshot
autosave``, ``%gpu_snapshot hibernate [gpu] after 30m``); each override belongs to the
notebook's path (to the kernel, for a kernel without a notebook: ``policy_key``). The
overrides are kept in one file, ``OVERRIDES_FILE``, in a directory the owner names (the
store's root), so they outlive a server restart. The record of a notebook holds autosave's
fields (``AutosavePolicy``) and hibernation's (``hibernation_policy``), as one object:
openapi.yaml's ``AutosavePolicy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import GPUSnapshot
from ..core import safe_fs
from ..core.errors import InvalidRequest
from .hibernation_policy import HIBERNATION_FIELDS, HibernationPolicy

# Dot files in the store's root are no snapshots (``snapshot.is_snapshot_id``).
OVERRIDES_FILE = ".autosave-policies.json"
OVERRIDES_LIMIT = 1 << 20

# What a notebook may override of autosave, and the JSON types each field accepts.
AUTOSAVE_FIELDS: Mapping[str, tuple[type, ...]] = {
    "enabled": (bool,),
    "interval_minutes": (int, float),
    "after_cell_minutes": (int, float),
    "during_cell": (bool,),
}
# Everything a notebook may override: the fields of ``PUT kernels/{id}/autosave``.
POLICY_FIELDS: Mapping[str, tuple[type, ...]] = {**AUTOSAVE_FIELDS, **HIBERNATION_FIELDS}


@dataclass(frozen=True)
class AutosavePolicy:
    """The autosave settings in force for one notebook."""

    enabled: bool
    interval_minutes: float
    after_cell_minutes: float
    during_cell: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NotebookPolicy(HibernationPolicy, AutosavePolicy):
    """Everything in force for one notebook: autosave's fields, then hibernation's (the
    ``policy`` of ``GET kernels/{id}/autosave``)."""


def policy_key(kernel_id: str, notebook_path: str | None) -> str:
    """What an override belongs to: the notebook's path, else the kernel."""
    return notebook_path or f"kernel:{kernel_id}"


def server_policy(settings: GPUSnapshot) -> NotebookPolicy:
    """The server's settings, for a notebook that overrides nothing."""
    s = settings
    return NotebookPolicy(
        enabled=bool(s.autosave),
        interval_minutes=float(s.autosave_interval_minutes),
        after_cell_minutes=float(s.autosave_after_cell_minutes),
        during_cell=bool(s.autosave_during_cell),
        **HibernationPolicy.from_settings(s).to_dict(),
    )


def check_override(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a policy override (``None`` resets a field to the server's setting)."""
    checked: dict[str, Any] = {}
    for key, value in changes.items():
        kinds = POLICY_FIELDS.get(key)
        if kinds is None:
            raise InvalidRequest(
                "request", f"unknown autosave field {key!r}",
                hint=f"allowed fields: {', '.join(POLICY_FIELDS)}",
            )
        if value is None:
            checked[key] = None
            continue
        number = float(value) if isinstance(value, (int, float)) else 0.0
        # JSON true is an int to Python; a number field must not take it.
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise InvalidRequest("request", f"autosave field {key!r} has the wrong type")
        if key.endswith("_minutes") and not number >= 0:
            raise InvalidRequest("request", f"autosave field {key!r} must be 0 or more")
        if key == "interval_minutes" and number == 0:
            raise InvalidRequest(
                "request", "an autosave interval of 0 minutes would save without pause",
                hint="turn autosave off with enabled=false instead",
            )
        checked[key] = number if key.endswith("_minutes") else value
    return checked


class NotebookPolicies:
    """The notebooks' overrides, kept in ``directory`` (made by the autosave scheduler,
    which loads them as it starts)."""

    def __init__(
        self, directory: Path, settings: GPUSnapshot, log: logging.Logger | None = None
    ) -> None:
        self.directory = directory
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self.path = directory / OVERRIDES_FILE
        # Policy key -> the fields that notebook overrides.
        self.overrides: dict[str, dict[str, Any]] = {}

    def load(self) -> None:
        """Take the overrides kept in the file (none, if it cannot be read)."""
        self.overrides = self.read_overrides()

    def policy(self, key: str) -> NotebookPolicy:
        """What is in force for the notebook (or kernel) of ``key``."""
        values = {**server_policy(self.settings).to_dict(), **self.overrides.get(key, {})}
        return NotebookPolicy(**values)

    def override(self, key: str) -> dict[str, Any]:
        """The fields the notebook of ``key`` overrides."""
        return dict(self.overrides.get(key, {}))

    async def change(self, key: str, changes: Mapping[str, Any]) -> NotebookPolicy:
        """Override fields of the notebook's policy (``None`` resets one to the server's
        setting) and keep the overrides; raises InvalidRequest for a wrong field."""
        checked = check_override(changes)
        mine = {**self.overrides.get(key, {}), **checked}
        mine = {k: v for k, v in mine.items() if v is not None}
        if mine:
            self.overrides[key] = mine
        else:
            self.overrides.pop(key, None)
        await asyncio.to_thread(self.write_overrides, dict(self.overrides))
        policy = self.policy(key)
        self.log.info("gpu-snapshot: autosave policy of %s is now %s", key, policy)
        return policy

    async def moved(self, source: str, dest: str) -> None:
        """The notebook (or folder) ``source`` is now ``dest``: its overrides go with it.
        Called by ``notebook_renames.NotebookRenames`` for each rename the server sees."""
        moved = {}
        for key, values in self.overrides.items():
            if key == source:
                moved[dest] = values
            elif key.startswith(source + "/"):
                moved[dest + key[len(source):]] = values
            else:
                moved.setdefault(key, values)
        if moved == self.overrides:
            return
        self.overrides = moved
        await asyncio.to_thread(self.write_overrides, dict(self.overrides))

    def read_overrides(self) -> dict[str, dict[str, Any]]:
        """The overrides kept in the file; a link or non-file there is ignored. Blocks."""
        try:
            with safe_fs.opened_dir(os.path.realpath(self.directory)) as dir_fd:
                data = json.loads(safe_fs.read_small(OVERRIDES_FILE, dir_fd, OVERRIDES_LIMIT))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.log.warning("gpu-snapshot: ignoring %s: %s", self.path, exc)
            return {}
        loaded: dict[str, dict[str, Any]] = {}
        for key, values in (data.items() if isinstance(data, dict) else []):
            with contextlib.suppress(InvalidRequest, AttributeError):
                loaded[str(key)] = {
                    k: v for k, v in check_override(values).items() if v is not None
                }
        return loaded

    def write_overrides(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Replace the file with ``overrides``. Blocks.

        The directory is made private (0700) if missing, as the store makes its root, and
        refused unless private; the file is written through the directory's fd, never
        through a link.
        """
        safe_fs.make_private_dirs(self.directory)
        safe_fs.tighten_own_dir(self.directory)
        safe_fs.require_private_dir(self.directory)
        spare = f"{OVERRIDES_FILE}.new"
        with safe_fs.opened_dir(os.path.realpath(self.directory)) as dir_fd:
            safe_fs.remove_at(spare, dir_fd)
            data = json.dumps(overrides, indent=2, sort_keys=True).encode()
            safe_fs.write_new(spare, dir_fd, data)
            os.replace(spare, OVERRIDES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
