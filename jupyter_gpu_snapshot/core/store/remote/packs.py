"""Pages in the remote store: packs that the chunked snapshots under one URL share.

Under the URL::

    packs/<pack>.pack             pages, 4 KiB each, in the order they were added
    packs/<pack>.ids              their ids, 16 bytes each: written after the pack, so a pack
                                  without ids is an upload that never finished
    packs/<pack>.<key id>.pack    the same, sealed with the key whose public id is <key id>
    packs/<pack>.<key id>.ids

``<pack>`` is random: no object name says anything of the content. The ids are the local
store's (``core/store/packs/``): BLAKE3 keyed with a key derived from the signing key, so nodes
that share a signing key share ids, and a reader who lacks that key learns nothing from
them; when the remote store is encrypted the ids are sealed as well, so the bucket does not
even show which pages two snapshots of one user share.

A sealed object is a run of AES-256-GCM records (``sealing.ChunkSealer``) of
``RECORD_BYTES`` of plaintext, bound to ``packs/<pack>``, to the object's kind and to its
plaintext size. A record is the smallest thing a reader can check, so a range read starts
and ends on record boundaries: fetching one lone page reads its whole record. At 64 KiB (16
pages) that over-fetch stays small next to a ranged GET's own cost, and the 28 bytes of
each record's nonce and tag cost 0.04 % of the pack; runs of needed pages that lie close
in a pack (``GAP_PAGES``) are fetched as one range anyway.

A remote manifest of a chunked snapshot lists the packs it needs (``packs``): the remote
collector (``RemoteStore.collect_packs``, called by ``RemoteStore.clean_incomplete`` and after
``RemoteStore.delete``) removes a pack that no remote manifest lists once it is older than
the grace given, so an upload in progress, whose manifest is not up yet, keeps its new
pack.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ... import safe_fs
from ..packs import ID_BYTES, PAGE, Ids, PackIndex, page_ids
from .objects import RemoteObjects, RemoteStoreError, damaged_copy, modified_time
from .sealing import RECORD_OVERHEAD, ChunkSealer, key_id

PACKS_DIR = "packs"
RECORD_BYTES = 64 << 10
# Needed pages this close in a pack are fetched in one range, the pages between with them.
GAP_PAGES = RECORD_BYTES // PAGE
READ_PAGES = (8 << 20) // PAGE  # one ranged GET at most
_OBJECT = re.compile(r"^([0-9a-f]{32}(?:\.[0-9a-f]{16})?)\.(pack|ids)$")
PACK, IDS = "pack", "ids"


def _plain_size(stored: int, sealed: bool) -> int:
    if not sealed:
        return stored
    records = max(1, -(-stored // (RECORD_BYTES + RECORD_OVERHEAD)))
    return stored - records * RECORD_OVERHEAD


@dataclass
class RemotePacks:
    """The packs under one remote store's URL."""

    objects: RemoteObjects

    @property
    def key_id(self) -> str | None:
        return key_id(self.objects.key) if self.objects.key else None

    def path(self, stem: str, kind: str) -> str:
        return f"{self.objects.root}/{PACKS_DIR}/{stem}.{kind}"

    def new_stem(self) -> str:
        name = secrets.token_hex(16)
        return f"{name}.{self.key_id}" if self.key_id else name

    def sealer(self, stem: str) -> ChunkSealer | None:
        """The sealer of a pack; None for a plain one. Refuses a pack of another key."""
        _, _, sealed_by = stem.partition(".")
        if not sealed_by:
            return None
        if self.objects.key is None or sealed_by != self.key_id:
            raise RemoteStoreError(
                "decrypt", f"the remote pack {stem} was sealed with another key (key id "
                f"{sealed_by}, this node has {self.key_id or 'none'})",
                hint="configure the key file that the uploading node used",
            )
        return ChunkSealer(self.objects.key, f"{PACKS_DIR}/{stem}", RECORD_BYTES)

    # -- listing ------------------------------------------------------------------------------
    def listing(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every pack's objects that are there: stem → kind → the listing's info."""
        self.objects.fs.invalidate_cache()
        try:
            found: dict[str, dict[str, Any]] = self.objects.retry(
                "list packs",
                lambda: self.objects.fs.find(f"{self.objects.root}/{PACKS_DIR}", detail=True),
            )
        except FileNotFoundError:
            return {}
        packs: dict[str, dict[str, dict[str, Any]]] = {}
        for path, info in found.items():
            match = _OBJECT.fullmatch(str(path).rsplit("/", 1)[-1])
            if match:
                packs.setdefault(match[1], {})[match[2]] = info
        return packs

    def usable(self, listing: dict[str, dict[str, dict[str, Any]]],
               reading: bool = False) -> list[str]:
        """The complete packs (ids written, and a pack as long as its ids say) an upload
        may name: those of its own sealing (its key, or plain without one), so that a
        snapshot's pages are sealed as it is. ``reading``: those a download may read, plain
        ones too (snapshots uploaded before a key was configured)."""
        usable = []
        for stem, kinds in sorted(listing.items()):
            if PACK not in kinds or IDS not in kinds:
                continue
            _, _, sealed_by = stem.partition(".")
            if (sealed_by or None) != self.key_id and not (reading and not sealed_by):
                continue
            sealer = self.sealer(stem)
            pages = _plain_size(int(kinds[IDS].get("size", -1)), sealer is not None) // ID_BYTES
            stored = sealer.stored_size(pages * PAGE) if sealer else pages * PAGE
            if int(kinds[PACK].get("size", -1)) == stored:
                usable.append(stem)
        return usable

    def require(self, snapshot_id: str, stems: list[str]) -> None:
        """Refuse before any transfer when a pack ``snapshot_id`` needs is missing or cut."""
        usable = set(self.usable(self.listing(), reading=True))
        for stem in stems:
            if stem not in usable:
                raise damaged_copy(snapshot_id, f"the remote pack {stem} is missing or cut off")

    def read_ids(self, stem: str) -> Ids:
        sealer = self.sealer(stem)
        path = self.path(stem, IDS)
        stored: bytes = self.objects.retry(f"get {stem}.{IDS}",
                                           lambda: self.objects.fs.cat_file(path))
        plain = sealer.open_run(IDS, 0, _plain_size(len(stored), True), stored) if sealer \
            else stored
        if len(plain) % ID_BYTES:
            raise RemoteStoreError("remote", f"the ids of the remote pack {stem} are cut off",
                                   hint="run the remote store's clean-up, then upload again")
        return np.frombuffer(plain, np.uint8).reshape(-1, ID_BYTES)

    def index(self, stems: list[str]) -> PackIndex:
        """Where each page of ``stems`` lives, from their ids objects (fetched at once)."""
        if not stems:
            return PackIndex()
        with ThreadPoolExecutor(self.objects.workers, thread_name_prefix="pack-ids") as pool:
            ids = list(pool.map(self.read_ids, stems))
        return PackIndex.build(stems, ids)

    # -- writing ------------------------------------------------------------------------------
    def put(self, ids: Ids, read: Callable[[int, int], bytes],
            advance: Callable[[int], None]) -> str:
        """Upload a new pack of the pages ``ids`` (``read(first, n)`` gives pages
        ``first..first+n`` of them), then its ids object: only then is it a pack. Returns
        its stem; on failure, what went up is removed (best effort) and the error raised."""
        stem = self.new_stem()
        sealer = self.sealer(stem)
        count = len(ids)
        plain_size = count * PAGE
        # Parts hold whole records, so that a part boundary is a record boundary.
        step_pages = max(RECORD_BYTES, self.objects.part_bytes // RECORD_BYTES * RECORD_BYTES)
        step_pages //= PAGE

        def body(part: int) -> bytes:
            first = part * step_pages
            pages = read(first, min(step_pages, count - first))
            advance(len(pages))
            if sealer is None:
                return pages
            return sealer.seal_run(PACK, first * PAGE // RECORD_BYTES, plain_size, pages)

        parts = -(-count // step_pages)
        try:
            if not self.objects.is_s3:  # a filesystem with real directories
                directory = f"{self.objects.root}/{PACKS_DIR}"
                self.objects.fs.makedirs(directory, exist_ok=True)
                if self.objects.is_local:  # pages are secrets: only the owner may enter
                    os.chmod(directory, 0o700)
            if self.objects.is_s3 and parts > 1:
                self._multipart(self.path(stem, PACK), parts, body)
            else:
                with self.objects.fs.open(self.path(stem, PACK), "wb") as out:
                    for part in range(parts):
                        out.write(body(part))
            plain_ids = ids.tobytes()
            stored_ids = sealer.seal_run(IDS, 0, len(plain_ids), plain_ids) if sealer \
                else plain_ids
            self.objects.retry("put pack ids", lambda: self.objects.fs.pipe_file(
                self.path(stem, IDS), stored_ids))
        except BaseException:
            self.remove(stem)
            raise
        return stem

    def _multipart(self, path: str, parts: int, body: Callable[[int], bytes]) -> None:
        fs = self.objects.fs
        bucket, key, _ = fs.split_path(path)
        upload_id = self.objects.retry("create_multipart_upload", lambda: fs.call_s3(
            "create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
        try:
            def one(part: int) -> dict[str, Any]:
                data = body(part)
                reply = self.objects.retry("upload_part", lambda: fs.call_s3(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                    PartNumber=part + 1, Body=data))
                return {"PartNumber": part + 1, "ETag": reply["ETag"]}

            with ThreadPoolExecutor(self.objects.workers, thread_name_prefix="pack") as pool:
                done = list(pool.map(one, range(parts)))
            self.objects.retry("complete_multipart_upload", lambda: fs.call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": done}))
        except BaseException:
            with contextlib.suppress(Exception):
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    def remove(self, stem: str) -> None:
        """Best effort: the ids first, so that what is left is no pack any more."""
        for kind in (IDS, PACK):
            with contextlib.suppress(Exception):
                self.objects.fs.rm_file(self.path(stem, kind))
        self.objects.fs.invalidate_cache()

    # -- reading ------------------------------------------------------------------------------
    def fetch(self, snapshot_id: str, index: PackIndex, wanted: Ids, out_fd: int,
              id_key: bytes, advance: Callable[[int], None]) -> None:
        """Write the pages ``wanted`` (each in some pack of ``index``) to ``out_fd``, page
        ``i`` at ``i * PAGE``, each checked against its id with ``id_key`` (ids are keyed
        digests: a page that does not hash to its id is refused, sealed or not)."""
        where = index.find(wanted)
        if (where < 0).any():
            raise damaged_copy(snapshot_id, "a page it needs is in no remote pack")
        packs, slots = index.pack_of[where], index.slot_of[where]
        order = np.lexsort((slots, packs))
        in_pack, at = packs[order], slots[order]
        # A range ends at another pack, at a gap of more than GAP_PAGES, and at each
        # READ_PAGES boundary of the pack, so that no GET is larger.
        ends = np.nonzero((np.diff(in_pack) != 0) | (np.diff(at) > GAP_PAGES)
                          | (np.diff(at // READ_PAGES) != 0))[0] + 1
        bounds = [0, *ends.tolist(), len(order)]
        jobs = [(int(in_pack[a]), order[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
        # A sealed record is bound to its pack's plaintext size: the pages its ids count.
        sizes = np.bincount(index.pack_of, minlength=len(index.packs)) * PAGE

        def job(item: tuple[int, npt.NDArray[np.int64]]) -> None:
            p, members = item
            stem = index.packs[p]
            sealer = self.sealer(stem)
            first_slot, last_slot = int(slots[members[0]]), int(slots[members[-1]])
            start, end = first_slot * PAGE, (last_slot + 1) * PAGE
            stored_start, stored_end = start, end
            if sealer is not None:
                start = start // RECORD_BYTES * RECORD_BYTES
                end = min(-(-end // RECORD_BYTES) * RECORD_BYTES, int(sizes[p]))
                stored_start = sealer.stored_offset(start)
                stored_end = stored_start + (end - start) + (
                    -(-(end - start) // RECORD_BYTES)) * RECORD_OVERHEAD
            path = self.path(stem, PACK)
            fetch = functools.partial(self.objects.fs.cat_file, path, start=stored_start,
                                      end=stored_end)
            stored: bytes = self.objects.retry(f"get {stem}.{PACK}", fetch)
            if len(stored) != stored_end - stored_start:
                raise damaged_copy(snapshot_id, f"the remote pack {stem} ended early")
            data = stored if sealer is None else sealer.open_run(
                PACK, start // RECORD_BYTES, int(sizes[p]), stored)
            block = np.frombuffer(data, np.uint8).reshape(-1, PAGE)
            picked = block[(slots[members] * PAGE - start) // PAGE]
            got, _ = page_ids(picked.tobytes(), id_key)
            if not np.array_equal(got, wanted[members]):
                raise damaged_copy(snapshot_id, f"a page of the remote pack {stem} does not "
                                   "match its id")
            # Members that follow each other in the output: one write.
            breaks = np.nonzero(np.diff(members) != 1)[0] + 1
            for start, end in zip([0, *breaks.tolist()], [*breaks.tolist(), len(members)],
                                  strict=True):
                safe_fs.pwrite_all(out_fd, picked[start:end].tobytes(), int(members[start]) * PAGE)
            advance(len(members) * PAGE)

        with ThreadPoolExecutor(self.objects.workers, thread_name_prefix="pages") as pool:
            list(pool.map(job, jobs))

    # -- collecting ---------------------------------------------------------------------------
    def garbage(self, referenced: set[str], cutoff: float) -> list[str]:
        """The packs no remote manifest lists (``referenced``) whose objects are all older
        than ``cutoff``; a younger one may belong to an upload whose manifest is not up
        yet. ``RemoteStore.collect_packs`` removes them."""
        return [
            stem for stem, kinds in sorted(self.listing().items())
            if stem not in referenced
            and max(modified_time(info) for info in kinds.values()) <= cutoff
        ]

