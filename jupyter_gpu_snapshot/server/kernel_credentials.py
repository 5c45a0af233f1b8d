"""What a snapshot-ready kernel's own credential reaches, and for how long.

A kernel calls the server with a credential of its own (``launch/kernel_token.py``), never
the server's token. The kernel's memory holds that credential, and so does every snapshot
of it, so it reaches what ``%gpu_snapshot`` needs and no more, only while the kernel runs:

- **While.** The credential is valid while the kernel's provisioner holds it: from the
  kernel's launch until its tree ends. A shutdown (the kernel leaves the kernel manager and
  its provisioner is cleaned up), a restart (a new launch gets a new credential) or a
  restore that replaces the kernel in its notebook (a shutdown) revokes it before that
  request is answered; a death, once the restarter finds the tree ended. A tree restored
  from a snapshot still holds the credential of the kernel it was saved from: that one
  speaks for the new kernel from the restore on, until the server has told the tree the new
  kernel's own.
- **What.** ``KernelReach``: its own kernel's routes (``kernels/{its id}/...``); the
  snapshots of its notebook (``notebook_path`` the path of the session that runs the
  kernel), those taken of this kernel (a kernel without a notebook has only those) and the
  one it was restored from: reading, renaming, deleting them and restoring them into its own
  session, or into a new session at its own notebook's path only (whoever opens a notebook
  next runs in the kernel its new session holds); the jobs of its kernel, those it asked
  for, and those about the snapshot it was restored from (a copy restored in the middle of
  a save asks for the save that made it). Not the store's usage, not other notebooks'
  snapshots, not other kernels' jobs or sessions.

The handlers check every request of a kernel's credential through ``KernelReach``, and
nothing else decides it. Refusals are 403s with code ``forbidden``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.errors import InvalidRequest
from ..launch.kernel_token import kernel_id_of_token, same_token
from ..launch.provisioner import SnapshotReadyProvisioner
from .jobs import Job
from .kernel_slots import KernelSlots

# The credentials of the kernels saved by this server, newest last, for their restored
# copies; older saves' copies get their own credential once their running cell ends.
SAVED_CREDENTIALS_KEPT = 10_000
# Where a kernel's credential does not reach, the user does: what to use instead.
ELSEWHERE = ("JupyterLab's snapshot panel, 'jupyter gpu-snapshot' or the REST API with the "
             "server's token reach every notebook's")


class OutOfReach(InvalidRequest):
    """A kernel's credential asked for what it does not reach, or is no longer valid:
    refused before any step ran, as a wrong request is, but answered 403."""

    code = "forbidden"


@dataclass(frozen=True)
class KernelReach:
    """What the credential of kernel ``kernel_id`` reaches, as of this request."""

    kernel_id: str
    # The notebook (or other document) whose session runs the kernel; None without one.
    notebook_path: str | None
    # The snapshot the kernel's tree was restored from; None for a launched kernel.
    restored_from: str | None

    def _refuse(self, cause: str, hint: str = ELSEWHERE) -> OutOfReach:
        return OutOfReach("authorize", f"kernel {self.kernel_id}'s own credential {cause}",
                          hint=hint)

    # -- kernels ---------------------------------------------------------------------------
    def reaches_kernel(self, kernel_id: str | None) -> bool:
        """Its own kernel only."""
        return kernel_id == self.kernel_id

    def require_kernel(self, kernel_id: str | None) -> None:
        if not self.reaches_kernel(kernel_id):
            raise self._refuse(
                "is valid for its own kernel only, not for "
                + (f"kernel {kernel_id}" if kernel_id else "every kernel"),
                hint="JupyterLab, 'jupyter gpu-snapshot' or the REST API with the server's "
                "token reach the other kernels")

    # -- snapshots -------------------------------------------------------------------------
    def reaches_snapshot(self, summary: dict[str, Any]) -> bool:
        """Whether ``summary`` (a snapshot's, as the API lists it) is one this kernel
        reaches: of its notebook, taken of this kernel, or the one it came from."""
        if self.restored_from is not None and summary.get("id") == self.restored_from:
            return True
        if self.notebook_path is not None and summary.get("notebook_path") == self.notebook_path:
            return True
        return bool((summary.get("kernel") or {}).get("kernel_id") == self.kernel_id)

    def snapshots(self, summaries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ones of ``summaries`` this kernel reaches."""
        return [s for s in summaries if self.reaches_snapshot(s)]

    def require_snapshot(self, summary: dict[str, Any]) -> None:
        if not self.reaches_snapshot(summary):
            raise self._refuse(
                f"reaches {self._its_snapshots()} only; snapshot {summary.get('id')} "
                f"({summary.get('name')}) is none of them")

    def require_listing(self, notebook_path: str | None) -> None:
        """A listing of one notebook's snapshots: this kernel's notebook only."""
        if notebook_path is not None and notebook_path != self.notebook_path:
            raise self._refuse(
                f"lists {self._its_snapshots()} only, not the snapshots of {notebook_path}")

    def require_new_session_at(self, path: str) -> None:
        """A restore into a new session at ``path`` (no session holds it): whoever opens
        that notebook next runs in the restored kernel, so its own notebook's path only."""
        if path != self.notebook_path:
            where = (f"its own notebook ({self.notebook_path})" if self.notebook_path
                     else "no notebook: it runs none")
            raise self._refuse(
                f"restores into a new session at {where} only, not at {path}")

    def require_store(self, what: str) -> None:
        """What covers every notebook's snapshots (the store's usage): never."""
        raise self._refuse(f"reaches {self._its_snapshots()} only, not {what}")

    def _its_snapshots(self) -> str:
        if self.notebook_path is None:
            return "the snapshots of this kernel (it runs no notebook)"
        return f"the snapshots of its notebook ({self.notebook_path}) and of this kernel"

    # -- jobs ------------------------------------------------------------------------------
    def reaches_job(self, job: Job) -> bool:
        """Its kernel's jobs, those it asked for (a restore's kernel is the new one), and
        those about the snapshot it was restored from."""
        return (
            job.kernel_id == self.kernel_id
            or job.requested_by == self.kernel_id
            or (job.snapshot_id is not None and job.snapshot_id == self.restored_from)
        )

    def require_job(self, job: Job) -> None:
        if not self.reaches_job(job):
            raise self._refuse(
                f"follows this kernel's jobs and the ones it asked for only; job {job.id} "
                f"is a {job.kind} of another kernel",
                hint="JupyterLab or the REST API with the server's token follow every job")


class KernelCredentials:
    """Which running kernel a kernel's credential speaks for; made by the service.

    The provisioners hold the credentials (``SnapshotReadyProvisioner.kernel_credential``):
    a credential is valid exactly while the provisioner of a kernel of this server holds it.
    """

    def __init__(self, kernel_manager: Any, slots: KernelSlots) -> None:
        self.kernel_manager = kernel_manager
        self.slots = slots
        # Snapshot id -> the credential its kernel held when it was saved.
        self._saved: OrderedDict[str, str] = OrderedDict()
        # New kernel id -> (credential, snapshot id) of the restores under way: a restored
        # tree runs, and may call, before the kernel manager has adopted it.
        self._restoring: dict[str, tuple[str, str]] = {}

    def kernel_of(self, token: str) -> str | None:
        """The id of the kernel whose running tree holds ``token``; None for a token that
        is no kernel's credential (the server's own, say). Raises OutOfReach for a kernel's
        credential that no running kernel holds any more."""
        claimed = kernel_id_of_token(token)
        if claimed is None:
            return None
        if self._holds(claimed, token):
            return claimed
        # A tree restored from a snapshot of the claimed kernel, not yet told its own.
        for kernel_id, (credential, _) in self._restoring.items():
            if same_token(credential, token):
                return kernel_id
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            provisioner = self._provisioner(kernel_id)
            if provisioner is not None and provisioner.inherited_credential is not None \
                    and provisioner.holds_credential(token):
                return str(kernel_id)
        raise OutOfReach(
            "authenticate",
            f"the credential of kernel {claimed} is no longer valid: that kernel was shut "
            "down, restarted, replaced by a restore or died, or the server restarted, since "
            "it was given",
            hint="each start of a kernel gets a new credential in $JUPYTER_GPU_SNAPSHOT_TOKEN; "
            "a restored kernel gets its own once the cell it was saved in has ended",
        )

    async def reach(self, kernel_id: str) -> KernelReach:
        """What the credential of ``kernel_id`` reaches now (its notebook may change)."""
        provisioner = self._provisioner(kernel_id)
        if provisioner is not None:
            restored_from = provisioner.adopted_snapshot
        else:  # a restored tree the kernel manager has not adopted yet
            restored_from = self._restoring.get(kernel_id, (None, None))[1]
        return KernelReach(
            kernel_id=kernel_id,
            notebook_path=await self.slots.notebook_path(kernel_id),
            restored_from=restored_from,
        )

    def _provisioner(self, kernel_id: str) -> SnapshotReadyProvisioner | None:
        if kernel_id not in self.kernel_manager:
            return None
        provisioner = getattr(self.kernel_manager.get_kernel(kernel_id), "provisioner", None)
        return provisioner if isinstance(provisioner, SnapshotReadyProvisioner) else None

    def _holds(self, kernel_id: str, token: str) -> bool:
        provisioner = self._provisioner(kernel_id)
        return provisioner is not None and provisioner.holds_credential(token)

    # -- restored copies -------------------------------------------------------------------
    def saved(self, snapshot_id: str, credential: str | None) -> None:
        """Called by a save once it has committed: ``credential`` is in the snapshot."""
        if credential is None:
            return
        self._saved[snapshot_id] = credential
        while len(self._saved) > SAVED_CREDENTIALS_KEPT:
            self._saved.popitem(last=False)

    def restoring(self, snapshot_id: str, kernel_id: str) -> str | None:
        """Called by a restore of ``snapshot_id`` into the new kernel ``kernel_id`` before
        criu runs: the credential the restored tree will hold (None when this server did
        not make it) speaks for ``kernel_id`` until ``restore_ended``, then the adopting
        kernel's provisioner holds it (``Adoption.credential``) until the tree is told its
        own."""
        credential = self._saved.get(snapshot_id)
        if credential is not None:
            self._restoring[kernel_id] = (credential, snapshot_id)
        return credential

    def restore_ended(self, kernel_id: str) -> None:
        self._restoring.pop(kernel_id, None)
