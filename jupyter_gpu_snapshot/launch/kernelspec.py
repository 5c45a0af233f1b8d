"""The ``python3-snapshot`` kernelspec: ipykernel launched through our provisioner.

The wheel ships it as data, ``share/jupyter/kernels/python3-snapshot/`` from
``kernelspec_files/`` (as ipykernel ships ``python3``), so ``pip install`` alone gives the
kernel; ``install`` writes it elsewhere (``--user``, another prefix) with this interpreter.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._constants import KERNEL_DISPLAY_NAME, KERNEL_NAME, PROVISIONER_NAME

# kernel.json (argv[0] "python": jupyter_client runs the server's own interpreter) and logo.
SHIPPED_SPEC = Path(__file__).parent / "kernelspec_files"
LOGO = "logo-svg.svg"


def kernel_json(python: str | None = None) -> dict[str, Any]:
    return {
        "argv": [
            python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
            # History lives in SQLite by default: a shared file that changes size under a
            # snapshot (CRIU then refuses the restore) and is locked across processes.
            "--HistoryManager.hist_file=:memory:",
            # IPython's banner draws a random tip from the global `random` on every
            # kernel_info request, so a client reconnecting after a restore would advance
            # the user's RNG state.
            "--InteractiveShell.enable_tip=False",
            # %gpu_snapshot in every snapshot-ready kernel. extra_extensions adds to, rather
            # than replaces, the extensions a user configured.
            "--IPKernelApp.extra_extensions=jupyter_gpu_snapshot",
        ],
        "display_name": KERNEL_DISPLAY_NAME,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {
            "debugger": True,
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {}},
        },
    }


def launches_through_provisioner(metadata: Mapping[str, Any] | None) -> bool:
    """Whether a kernelspec with this ``metadata`` (kernel.json's) launches its kernels
    through our provisioner, which makes them snapshot-ready; the one check of it, for the
    server's kernelspecs and a manifest's."""
    provisioner = (metadata or {}).get("kernel_provisioner") or {}
    return bool(provisioner.get("provisioner_name") == PROVISIONER_NAME)


def is_snapshot_ready_kernelspec(name: str) -> bool:
    """Whether ``name`` is an installed kernelspec that launches through our provisioner:
    the manifest policy's ``kernel_allowed`` (``node/local_engine.py``)."""
    # jupyter_client is imported when asked: the CLI starts without it.
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    return launches_through_provisioner(spec.metadata)


def install(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp) / KERNEL_NAME
        spec_dir.mkdir()
        (spec_dir / "kernel.json").write_text(json.dumps(kernel_json(), indent=2))
        (spec_dir / LOGO).write_bytes((SHIPPED_SPEC / LOGO).read_bytes())
        if prefix is None and not user:
            prefix = sys.prefix
        dest: str = KernelSpecManager().install_kernel_spec(
            str(spec_dir), KERNEL_NAME, user=user, prefix=prefix
        )
    return dest
