"""The manifest's format: a JSON schema with a version, plus the checks a schema cannot say.

A manifest is read only after its signature matched; the schema is a second wall, so that
even a signed manifest cannot name a path outside the snapshot, a log file outside the
kernel-log directory, or a kernel connection other than TCP.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from .digest import ALGORITHMS

# 3 added the "node" section (a reader of 2 refuses its unknown field); 2 is still read.
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)
# Written before manifests were signed: read only to be listed as unsigned, and trusted.
LEGACY_FORMAT = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 4 << 20
ID_PATTERN = r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# An image file name: no slash, no leading dot (so never '..'), never the manifest.
FILE_NAME_PATTERN = r"^(?!manifest\.json$)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
KERNEL_LOG_PATTERN = re.compile(r"^kernel-[A-Za-z0-9_-]{1,64}\.log$")
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
NULLABLE_STRING = {"type": ["string", "null"], "maxLength": 4096}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "jupyter_gpu_snapshot manifest",
    "type": "object",
    "required": ["format", "id", "name", "created", "kernel", "digest", "files", "signature"],
    "additionalProperties": False,
    "properties": {
        "format": {"enum": list(READABLE_FORMATS)},
        "id": {"type": "string", "pattern": ID_PATTERN},
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "created": {"type": "number", "minimum": 0},
        "host": {"type": "string", "maxLength": 255},
        "reason": {"type": "string", "pattern": r"^[a-z_-]{1,32}$"},
        "digest": {"enum": list(ALGORITHMS)},
        "files": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": FILE_NAME_PATTERN},
            "additionalProperties": {
                "type": "object",
                "required": ["size", "digest"],
                "additionalProperties": False,
                "properties": {
                    "size": {"type": "integer", "minimum": 0},
                    "digest": {"type": "string", "pattern": r"^[0-9a-f]{64}$"},
                },
            },
        },
        "kernel": {
            "type": "object",
            "required": ["name", "connection_info", "log_files"],
            "additionalProperties": False,
            "properties": {
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
                "log_files": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {"type": "string", "maxLength": 4096},
                },
                "connection_info": {
                    "type": "object",
                    "required": [
                        "transport", "ip", "key", "signature_scheme", "shell_port",
                        "iopub_port", "stdin_port", "control_port", "hb_port",
                    ],
                    "additionalProperties": False,
                    "properties": {
                        "transport": {"const": "tcp"},
                        "ip": {"type": "string", "maxLength": 64},
                        "key": {"type": "string", "maxLength": 256},
                        "signature_scheme": {"enum": ["hmac-sha256", "hmac-sha512", ""]},
                        "kernel_name": {"type": "string", "maxLength": 128},
                        "shell_port": PORT,
                        "iopub_port": PORT,
                        "stdin_port": PORT,
                        "control_port": PORT,
                        "hb_port": PORT,
                    },
                },
            },
        },
        "versions": {"type": "object", "additionalProperties": {"type": "string"}},
        "timings": {"type": "object", "additionalProperties": {"type": "number"}},
        "gpu": {"type": ["object", "null"]},
        # The node that saved it, compared at restore (core/compatibility.py).
        "node": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "hostname": {"type": "string", "maxLength": 255},
                "cpu": {
                    "type": "object",
                    "required": ["arch", "flags"],
                    "additionalProperties": False,
                    "properties": {
                        "arch": {"type": "string", "maxLength": 64},
                        "model": {"type": "string", "maxLength": 256},
                        "flags": {
                            "type": "array",
                            "maxItems": 2048,
                            "items": {"type": "string", "maxLength": 64},
                        },
                    },
                },
                "kernel": {
                    "type": "object",
                    "required": ["release", "machine"],
                    "additionalProperties": False,
                    "properties": {
                        "release": {"type": "string", "maxLength": 256},
                        "machine": {"type": "string", "maxLength": 64},
                    },
                },
                "mapped_files": {
                    "type": "object",
                    "required": ["algorithm", "files"],
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": list(ALGORITHMS)},
                        "seconds": {"type": "number", "minimum": 0},
                        "files": {
                            "type": "array",
                            "maxItems": 20000,
                            "items": {
                                "type": "object",
                                "required": ["path", "size", "digest"],
                                "additionalProperties": False,
                                "properties": {
                                    "path": {"type": "string", "pattern": "^/",
                                             "maxLength": 4096},
                                    "size": {"type": "integer", "minimum": 0},
                                    "digest": {"type": "string", "pattern": r"^[0-9a-f]{64}$"},
                                    # device, inode, mtime and ctime (ns) at the save
                                    "identity": {
                                        "type": "array",
                                        "items": {"type": "integer", "minimum": 0},
                                        "minItems": 4,
                                        "maxItems": 4,
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
        # What a restore would get wrong, said at the save (open_files.OpenFilesHook).
        "warnings": {
            "type": "array",
            "maxItems": 256,
            "items": {"type": "string", "maxLength": 4096},
        },
        # Files the kernel had open or mapped that its image does not hold, checked at restore.
        "open_files": {
            "type": "array",
            "maxItems": 10000,
            "items": {
                "type": "object",
                "required": ["path", "size", "mtime_ns"],
                "additionalProperties": False,
                "properties": {
                    "path": {"type": "string", "pattern": "^/", "maxLength": 4096},
                    "size": {"type": "integer", "minimum": 0},
                    "mtime_ns": {"type": "integer"},
                    "sha256": {"type": "string", "pattern": r"^[0-9a-f]{64}$"},
                },
            },
        },
        # Committed by a recovery, after the process that saved it died.
        "recovered": {"type": "boolean"},
        "signature": {
            "type": "object",
            "required": ["algorithm", "key_id", "value"],
            "additionalProperties": False,
            "properties": {
                "algorithm": {"const": "HMAC-SHA256"},
                "key_id": {"type": "string"},
                "value": {"type": "string", "pattern": r"^[0-9a-f]{64}$"},
            },
        },
    },
}

CONNECTION_KEYS = tuple(
    SCHEMA["properties"]["kernel"]["properties"]["connection_info"]["properties"]
)
_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


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
    error = next(iter(sorted(_VALIDATOR.iter_errors(manifest), key=lambda e: e.path)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        return f"manifest field {where}: {error.message[:200]}"
    if manifest["id"] != directory_name:
        return f"manifest names id {manifest['id']}, but lives in {directory_name}"
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
