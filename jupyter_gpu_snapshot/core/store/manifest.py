"""The manifest's format: a JSON schema with a version, plus the checks a schema cannot say.

A manifest is read only after its signature matched; the schema is a second wall, so that
even a signed manifest cannot name a path outside the snapshot, a log file outside the
kernel-log directory, or a kernel connection other than TCP.

FORMAT (defined here, ``SCHEMA`` below; the store writes, signs and reads it)

``<store>/<id>/manifest.json`` (``MANIFEST``, at most 4 MiB): one JSON object, written with
sorted keys and an indent of 2, 0600, fsynced, then published with its directory by one
rename (``SnapshotStore.commit``); a later change (a new name, a new signature) writes it
beside, under a name with a leading dot, and renames it over. ``SCHEMA`` is its JSON Schema
(draft 2020-12): its records are closed (no field they do not name), but for
``kernel.spec`` and ``gpu``, kept as the save found them; its comments say what each
section is for. In short:

- ``format``: ``FORMAT_VERSION`` (5); formats 2 to 4 are still read. A manifest of format 1
  (``LEGACY_FORMAT``) carries no signature: it is listed as unsigned, and restorable only
  once ``jupyter gpu-snapshot trust`` signed it (``SnapshotStore.trust``);
- ``id`` (``ID_PATTERN``, the directory's name), ``name`` (``NAME_PATTERN``), ``created``
  (seconds since the epoch), ``host``, ``reason``;
- ``digest``: the algorithm of every file digest, ``blake3`` or ``sha256-tree-64MiB``
  (the sha256 of a tag and of each 64 MiB piece's sha256, ``digest.py``);
- ``files``: each image file by name (``FILE_NAME_PATTERN``: no slash, no leading dot),
  its ``size`` and ``digest`` (hex), and for a file kept as a recipe, ``chunks``, the
  BLAKE3 of its recipe (``packs/recipes.py``);
- ``stored``: the bytes the save added to the store (``whole_bytes``, ``new_page_bytes``,
  ``recipe_bytes``, ``zero_page_bytes``), for sizes people read;
- ``kernel``: its kernelspec name, connection info (TCP only), pids, notebook path and log
  files (``kernel-<id>.log`` in this server's kernel-log directory, ``problem``);
- ``node``, ``versions``, ``timings``, ``gpu``, ``external_files``, ``open_files``,
  ``warnings``, ``history``, ``portable``, ``recovered``: see their comments in ``SCHEMA``;
- ``signature``: ``algorithm`` ``HMAC-SHA256``, the signing key's ``key_id``, and
  ``value``, the hex HMAC of every other field as canonical JSON (sorted keys, no spaces,
  ASCII, no NaN: ``signing.canonical``).

Before criu dumps, a save writes the manifest as far as it is known (no ``files``,
``digest``, ``stored`` or ``signature``, and ``"verified": false``) to
``.manifest-draft.json`` in its partial directory: what a recovery commits when the saving
process died (``core/recovery.py``).
"""
from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._constants import HISTORY_SOURCE_BYTES
from .digest import ALGORITHMS

# 3 added the "node" section (a reader of 2 refuses its unknown field); 4 added files kept
# by content ("chunks") and the "stored" section; 5 the cells the kernel ran ("history")
# and its portable copy ("portable"). 2 to 4 are still read.
FORMAT_VERSION = 5
READABLE_FORMATS = (2, 3, 4, 5)
# Written before manifests were signed: read only to be listed as unsigned, and trusted.
LEGACY_FORMAT = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 4 << 20
ID_PATTERN = r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# An image file name: no slash, no leading dot (so never '..'), never the manifest.
FILE_NAME_PATTERN = r"^(?!manifest\.json$)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
KERNEL_LOG_PATTERN = re.compile(r"^kernel-[A-Za-z0-9_-]{1,64}\.log$")
# The files of a portable copy of the namespace (kernel/portable/) share the snapshot's
# directory and file list with the images; criu is never handed them.
PORTABLE_PREFIX = "portable."
PYTHON_NAME = {"type": "string", "maxLength": 256}


def _record(properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    """An object with the ``properties`` listed and no other: every object of a manifest is
    closed, so that no field a later reader might trust gets in unchecked."""
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False,
                              "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def _array(items: dict[str, Any], max_items: int) -> dict[str, Any]:
    return {"type": "array", "maxItems": max_items, "items": items}


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
NULLABLE_STRING = {"type": ["string", "null"], "maxLength": 4096}
SIZE = {"type": "integer", "minimum": 0}
HEX_DIGEST = {"type": "string", "pattern": r"^[0-9a-f]{64}$"}
ABSOLUTE_PATH = {"type": "string", "pattern": "^/", "maxLength": 4096}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "jupyter_gpu_snapshot manifest",
    **_record(required=[
        "format", "id", "name", "created", "kernel", "digest", "files", "signature",
    ], properties={
        "format": {"enum": list(READABLE_FORMATS)},
        "id": {"type": "string", "pattern": ID_PATTERN},
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "created": {"type": "number", "minimum": 0},
        "host": _string(255),
        "reason": {"type": "string", "pattern": r"^[a-z_-]{1,32}$"},
        "digest": {"enum": list(ALGORITHMS)},
        "files": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": FILE_NAME_PATTERN},
            "additionalProperties": _record(
                required=["size", "digest"], properties={
                    "size": SIZE,
                    "digest": HEX_DIGEST,
                    # kept as a recipe of pages (packs/recipes.py): the recipe's BLAKE3
                    "chunks": HEX_DIGEST,
                },
            ),
        },
        # What the save added to the store, in bytes: for sizes people read.
        "stored": {"type": "object", "additionalProperties": SIZE},
        "kernel": _record(required=["name", "connection_info", "log_files"], properties={
            "name": {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,128}$"},
            "spec": {"type": ["object", "null"]},
            "kernel_id": NULLABLE_STRING,
            # A notebook's API path: relative, and no '..' component.
            "notebook_path": {
                "type": ["string", "null"],
                "maxLength": 4096,
                "pattern": r"^(?!/)(?!(.*/)?\.\.(/|$))",
            },
            "pid": {"type": "integer", "minimum": 1},
            "root_pid": {"type": "integer", "minimum": 1},
            # The root's start time: a recovery tells a live kernel from a reused pid.
            "root_started": {"type": ["number", "null"]},
            "log_files": _array(_string(4096), 16),
            "connection_info": _record(required=[
                "transport", "ip", "key", "signature_scheme", "shell_port",
                "iopub_port", "stdin_port", "control_port", "hb_port",
            ], properties={
                "transport": {"const": "tcp"},
                "ip": _string(64),
                "key": _string(256),
                "signature_scheme": {"enum": ["hmac-sha256", "hmac-sha512", ""]},
                "kernel_name": _string(128),
                "shell_port": PORT,
                "iopub_port": PORT,
                "stdin_port": PORT,
                "control_port": PORT,
                "hb_port": PORT,
            }),
        }),
        "versions": {"type": "object", "additionalProperties": {"type": "string"}},
        "timings": {"type": "object", "additionalProperties": {"type": "number"}},
        "gpu": {"type": ["object", "null"]},
        # Files criu dumped as external (the node agent's saves): criu's key -> path.
        "external_files": {
            "type": "object", "maxProperties": 65536,
            "propertyNames": {"pattern": r"^file\[[0-9a-f]+:[0-9a-f]+\]$"},
            "additionalProperties": ABSOLUTE_PATH,
        },
        # The device and inode at the save of each external file and working directory,
        # by path: a restore through the node agent refuses a working directory or an
        # executable whose path now leads elsewhere.
        "path_identities": {
            "type": "object", "maxProperties": 65536,
            "propertyNames": ABSOLUTE_PATH,
            "additionalProperties": {
                "type": "array", "minItems": 2, "maxItems": 2,
                "items": {"type": "integer", "minimum": 0},
            },
        },
        # The node that saved it, compared at restore (core/compatibility.py).
        "node": _record({
            "hostname": _string(255),
            "cpu": _record(required=["arch", "flags"], properties={
                "arch": _string(64),
                "model": _string(256),
                "flags": _array(_string(64), 2048),
            }),
            "kernel": _record(required=["release", "machine"], properties={
                "release": _string(256),
                "machine": _string(64),
            }),
            "mapped_files": _record(required=["algorithm", "files"], properties={
                "algorithm": {"enum": list(ALGORITHMS)},
                "seconds": {"type": "number", "minimum": 0},
                "files": _array(_record(required=["path", "size", "digest"], properties={
                    "path": ABSOLUTE_PATH,
                    "size": SIZE,
                    "digest": HEX_DIGEST,
                    # device, inode, mtime and ctime (ns) at the save
                    "identity": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 4,
                        "maxItems": 4,
                    },
                }), 20000),
            }),
        }),
        # What a restore would get wrong, said at the save (open_files.OpenFilesHook).
        "warnings": _array(_string(4096), 256),
        # Files the kernel had open or mapped that its image does not hold, checked at restore.
        "open_files": _array(_record(required=["path", "size", "mtime_ns"], properties={
            "path": ABSOLUTE_PATH,
            "size": SIZE,
            "mtime_ns": {"type": "integer"},
            "sha256": HEX_DIGEST,
        }), 10000),
        # The cells the kernel ran, in order, from its own history, and the names each
        # defined: what a replay re-runs (node/fallback.py). "complete" is false when older
        # cells were left out to keep the manifest small.
        "history": _record(required=["cells", "complete"], properties={
            "cells": _array(_record(required=["count", "source", "defined"], properties={
                "count": {"type": "integer", "minimum": 0},
                "source": _string(HISTORY_SOURCE_BYTES),
                "defined": _array(PYTHON_NAME, 4096),
                "ok": {"type": "boolean"},  # false: the cell raised when it ran
            }), 100000),
            "complete": {"type": "boolean"},
            "omitted": {"type": "integer", "minimum": 0},
        }),
        # The portable copy of the namespace, written by the kernel before the pause; its
        # files are in "files" (named PORTABLE_PREFIX...), digested and signed with the rest.
        "portable": _record(required=["files", "carried", "not_carried"], properties={
            "files": _array({"type": "string", "pattern": "^portable\\.[A-Za-z0-9._-]{1,118}$"},
                            4096),
            "carried": _array(_record(required=["name", "kind"], properties={
                "name": PYTHON_NAME,
                "kind": _string(256),
                "bytes": SIZE,
                "devices": _array(_string(64), 64),
                # the name's pickle, and for a module carried by reference, its name
                "file": {"type": "string", "pattern": "^portable\\.[A-Za-z0-9._-]{1,118}$"},
                "module": _string(256),
            }), 100000),
            "not_carried": _array(_record(required=["name", "reason"], properties={
                "name": PYTHON_NAME,
                "reason": _string(1024),
            }), 100000),
            "bytes": SIZE,
            "seconds": {"type": "number", "minimum": 0},
            "format": {"type": "integer", "minimum": 1},
        }),
        # Committed by a recovery, after the process that saved it died.
        "recovered": {"type": "boolean"},
        "signature": _record(required=["algorithm", "key_id", "value"], properties={
            "algorithm": {"const": "HMAC-SHA256"},
            "key_id": {"type": "string"},
            "value": HEX_DIGEST,
        }),
    }),
}

CONNECTION_KEYS = tuple(
    SCHEMA["properties"]["kernel"]["properties"]["connection_info"]["properties"]
)


@functools.cache
def _validator(section: str | None = None) -> Callable[[Any], Any]:
    """The schema, or its ``section``, compiled to Python by fastjsonschema at its first use:
    a listing checks every manifest, and the compiled check costs a small part of what
    jsonschema's took, nor does it import any format grammar (docs/performance.md)."""
    import fastjsonschema

    return fastjsonschema.compile(SCHEMA if section is None else SCHEMA["properties"][section])


def _schema_error(instance: Any, section: str | None = None) -> tuple[str, str] | None:
    """Where ``instance`` first breaks the schema (its fields joined by /, "(top)" for the
    whole) and how, or None when it holds."""
    import fastjsonschema

    try:
        _validator(section)(instance)
    except fastjsonschema.JsonSchemaValueException as exc:
        where = "/".join(str(p) for p in exc.path[1:]) or "(top)"
        return where, exc.message.removeprefix(str(exc.name)).strip()[:200]
    return None


@dataclass(frozen=True)
class ManifestPolicy:
    """What this node accepts beyond the schema; supplied by whoever builds the engine.

    ``kernel_log_dir`` returns the directory kernel logs of this server live in;
    ``kernel_allowed`` says whether a kernelspec name is an installed snapshot-ready one.
    """

    kernel_log_dir: Callable[[], Path] | None = None
    kernel_allowed: Callable[[str], bool] | None = None


class ManifestProblem(ValueError):
    """A manifest that must not be used; the message says why."""


def problem(manifest: Any, directory_name: str, policy: ManifestPolicy) -> str | None:
    """Why ``manifest`` is not a valid manifest of the snapshot ``directory_name``, or None."""
    error = _schema_error(manifest)
    if error is not None:
        where, how = error
        return f"manifest field {where}: {how}"
    if manifest["id"] != directory_name:
        return f"manifest names id {manifest['id']}, but lives in {directory_name}"
    missing = [name for name in (manifest.get("portable") or {}).get("files", ())
               if name not in manifest["files"]]
    if missing:
        return f"portable file {missing[0]!r} is not among the snapshot's files"
    kernel = manifest["kernel"]
    try:
        ipaddress.ip_address(kernel["connection_info"]["ip"])
    except ValueError:
        return f"kernel ip {kernel['connection_info']['ip']!r} is not an IP address"
    log_dir = policy.kernel_log_dir() if policy.kernel_log_dir else None
    for path in kernel["log_files"]:
        if not os.path.isabs(path) or os.path.normpath(path) != path:
            return f"log file {path!r} is not an absolute, normalised path"
        if not KERNEL_LOG_PATTERN.fullmatch(os.path.basename(path)):
            return f"log file {path!r} is not named kernel-ID.log"
        if log_dir is not None and Path(os.path.dirname(path)) != log_dir:
            return f"log file {path!r} is outside this server's kernel-log directory {log_dir}"
    return None


def kernel_problem(manifest: dict[str, Any], policy: ManifestPolicy) -> str | None:
    """Why the snapshot's kernelspec cannot run here (checked at restore), or None."""
    name = str(manifest["kernel"]["name"])
    if policy.kernel_allowed is not None and not policy.kernel_allowed(name):
        return f"kernel {name!r} is not an installed snapshot-ready kernelspec"
    return None


def is_portable_file(name: str) -> bool:
    """Whether ``name``, a file of a snapshot, belongs to its portable copy, not its image."""
    return name.startswith(PORTABLE_PREFIX)


def bounded_history(history: Any) -> dict[str, Any]:
    """``history`` as a manifest keeps it: checked against the schema (it comes from the
    kernel, which any code in it may have changed), and cut to the newest cells whose
    source fits HISTORY_SOURCE_BYTES. Raises ManifestProblem for a malformed one."""
    error = _schema_error(history, "history")
    if error is not None:
        raise ManifestProblem(f"the kernel's cell history: {error[0]} {error[1]}")
    cells = list(history["cells"])
    kept: list[dict[str, Any]] = []
    size = 0
    for cell in reversed(cells):
        size += len(cell["source"].encode())
        if size > HISTORY_SOURCE_BYTES:
            break
        kept.append(cell)
    kept.reverse()
    omitted = int(history.get("omitted", 0)) + len(cells) - len(kept)
    bounded: dict[str, Any] = {"cells": kept, "complete": bool(history["complete"])
                               and omitted == 0}
    if omitted:
        bounded["omitted"] = omitted
    return bounded


def portable_problem(report: Any, written: Sequence[str]) -> str | None:
    """Why the kernel's report of its portable copy cannot go into a manifest, or None.
    ``written``: the names of the files found in the snapshot's directory."""
    error = _schema_error(report, "portable")
    if error is not None:
        return f"the portable copy's report: {error[0]} {error[1]}"
    listed = set(report["files"])
    found = {name for name in written if is_portable_file(name)}
    if listed != found:
        return (f"the portable copy's report lists {sorted(listed - found)[:3]} not written, "
                f"or leaves out {sorted(found - listed)[:3]}")
    return None


def fallbacks_offered(manifest: dict[str, Any]) -> list[str]:
    """The ways back a snapshot offers if its image cannot come back
    (``node/fallback.py``): ``portable`` when it holds a portable copy, ``replay`` when it
    recorded cells, ``both`` when it has both."""
    modes = []
    portable = bool((manifest.get("portable") or {}).get("files"))
    replay = bool((manifest.get("history") or {}).get("cells"))
    if portable:
        modes.append("portable")
    if replay:
        modes.append("replay")
    if portable and replay:
        modes.append("both")
    return modes
