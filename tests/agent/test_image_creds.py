"""The credentials check before a restore, against real CRIU dumps and forgeries of them.

Two dumps are made once for the module: a two-threaded process of nobody's, and a root
``sleep``. A forgery rewrites one thread's creds in a copy of nobody's dump, re-encoding
every enclosing protobuf message and CRIU entry with the new lengths, so the forged file is
one that CRIU would read. The encoder here is the tests' own, not the module's decoder run
backwards.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.agent.credentials.in_images import (
    Caller,
    check_image_credentials,
    image_credentials,
)
from jupyter_gpu_snapshot.core.errors import InvalidRequest

CRIU = shutil.which("criu") or "/usr/local/sbin/criu"
NOBODY = 65534
AS_NOBODY = Caller(uid=NOBODY, gid=NOBODY, groups=frozenset())

# A second thread, so that the dump holds two core images.
TWO_THREADS = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    "time.sleep(600)\n"
)

# Field numbers, from CRIU's images/core.proto and images/creds.proto.
THREAD_CORE, CREDS = 5, 10
UID, GID, EUID, EGID, SUID, SGID, FSUID, FSGID = range(1, 9)
CAP_INH, CAP_PRM, CAP_EFF, SECBITS, GROUPS, CAP_AMB = 9, 10, 11, 13, 14, 19


# --- the dumps --------------------------------------------------------------------------


def _python_that_runs_as(uid: int) -> str:
    """An interpreter that ``uid`` may execute (a virtualenv under /root is not one)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run(
                [candidate, "-c", ""], user=uid, group=uid, extra_groups=[], cwd="/",
                capture_output=True, timeout=120,
            )  # fmt: skip
        except OSError:
            continue
        if probe.returncode == 0:
            return candidate
    pytest.fail(f"no Python interpreter that uid {uid} may run")


def _criu_as(uid: int) -> list[str]:
    """How to run criu to dump a process of ``uid``.

    Root reads another user's rlimits (prlimit) only with CAP_SYS_RESOURCE, which root
    lacks in many containers. So criu runs as the process's own user, unprivileged, with
    root's capabilities passed on as ambient ones: the dump is the one a user gets of their
    own process.
    """
    if uid == 0:
        return [CRIU]
    status = Path("/proc/self/status").read_text()
    effective = int(next(line for line in status.splitlines() if line.startswith("CapEff:"))
                    .split()[1], 16)  # fmt: skip
    caps = ",".join(f"+cap_{bit}" for bit in range(64) if effective >> bit & 1)
    return [
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        f"--inh-caps={caps}", f"--ambient-caps={caps}", CRIU, "--unprivileged",
    ]  # fmt: skip


def _dump(argv: list[str], uid: int, threads: int, directory: Path) -> Path:
    """Starts ``argv`` as ``uid``, waits for its ``threads`` threads, dumps it with criu."""
    images = directory / "images"
    images.mkdir()
    log = directory / "dump.log"
    switch = uid != 0  # root's process keeps root's ids and groups
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd="/", start_new_session=True, user=uid if switch else None,
        group=uid if switch else None, extra_groups=[] if switch else None,
    )  # fmt: skip
    try:
        tasks = Path(f"/proc/{process.pid}/task")
        deadline = time.monotonic() + 120  # a busy machine may take long to start Python
        while len(list(tasks.iterdir())) < threads:
            assert process.poll() is None, f"{argv} exited with {process.returncode}"
            assert time.monotonic() < deadline, f"{argv} did not start {threads} threads"
            time.sleep(0.1)
        command = [
            *_criu_as(uid), "dump", "-t", str(process.pid), "-D", str(images),
            "--shell-job", "-v2", "--log-file", str(log),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        log_text = log.read_text() if log.exists() else "(no log)"
        assert result.returncode == 0, f"criu dump failed: {result.stderr}\n{log_text}"
    finally:
        process.kill()  # criu has killed it already after a dump; this is for a failure
        process.wait(timeout=60)
    return images


@pytest.fixture(scope="module")
def nobody_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    argv = [_python_that_runs_as(NOBODY), "-c", TWO_THREADS]
    return _dump(argv, NOBODY, 2, tmp_path_factory.mktemp("nobody"))


@pytest.fixture(scope="module")
def root_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sleep = shutil.which("sleep") or "/bin/sleep"
    return _dump([sleep, "600"], 0, 1, tmp_path_factory.mktemp("root"))


@pytest.fixture
def copy(nobody_dump: Path, tmp_path: Path) -> Path:
    """A copy of nobody's dump, to forge."""
    return Path(shutil.copytree(nobody_dump, tmp_path / "images"))


def _first_core(images: Path) -> Path:
    return sorted(images.glob("core-*.img"))[0]


# --- a protobuf encoder, for forging ----------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, position


def _split(message: bytes) -> list[tuple[int, bytes]]:
    """The fields of ``message`` in order: (field number, the field's bytes, key included)."""
    fields = []
    position = 0
    while position < len(message):
        start = position
        key, position = _read_varint(message, position)
        wire_type = key & 7
        if wire_type == 0:
            _, position = _read_varint(message, position)
        elif wire_type == 2:
            length, position = _read_varint(message, position)
            position += length
        else:
            position += {1: 8, 5: 4}[wire_type]
        fields.append((key >> 3, message[start:position]))
    return fields


def _payload(field: bytes) -> bytes:
    """What a length-delimited field holds."""
    _, position = _read_varint(field, 0)
    length, position = _read_varint(field, position)
    return field[position : position + length]


def _message_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _uint32_fields(number: int, values: list[int], packed: bool) -> bytes:
    if packed:
        return _message_field(number, b"".join(_varint(value) for value in values))
    return b"".join(_varint(number << 3) + _varint(value) for value in values)


Edit = Callable[[bytes], bytes]


def _edit_field(message: bytes, number: int, edit: Edit) -> bytes:
    """``message`` with the message in its field ``number`` replaced by ``edit`` of it."""
    assert number in [found for found, _ in _split(message)], f"no field {number}"
    return b"".join(
        _message_field(number, edit(_payload(field))) if found == number else field
        for found, field in _split(message)
    )


def _without(number: int) -> Edit:
    return lambda message: b"".join(f for found, f in _split(message) if found != number)


def _with_creds(values: dict[int, int | list[int]], packed: bool = False) -> Edit:
    """An edit of a creds message: the fields named get the values given, the rest stay."""

    def edit(creds: bytes) -> bytes:
        kept = b"".join(field for found, field in _split(creds) if found not in values)
        for number, value in values.items():
            kept += _uint32_fields(number, value if isinstance(value, list) else [value], packed)
        return kept

    return edit


def _forge_core_entry(path: Path, edit: Edit) -> None:
    """Rewrites the core_entry of the core image at ``path`` with ``edit``; the header and
    the entry's length prefix are written anew."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, 8)
    assert len(data) == 12 + length, "a core image holds one entry"
    core_entry = edit(data[12:])
    path.write_bytes(data[:8] + struct.pack("<I", len(core_entry)) + core_entry)


def _forge_thread_core(path: Path, edit: Edit) -> None:
    _forge_core_entry(path, lambda core: _edit_field(core, THREAD_CORE, edit))


def _forge_creds(path: Path, edit: Edit) -> None:
    _forge_thread_core(path, lambda thread_core: _edit_field(thread_core, CREDS, edit))


def _refusal(images: Path, caller: Caller = AS_NOBODY) -> str:
    with pytest.raises(InvalidRequest) as refused:
        check_image_credentials(images, caller)
    assert refused.value.step == "restore"
    assert refused.value.code == "invalid_request"
    assert "only images of your own unprivileged processes" in str(refused.value)
    return refused.value.cause


# --- real dumps -------------------------------------------------------------------------


def test_every_thread_of_nobodys_dump_runs_as_nobody(nobody_dump: Path) -> None:
    found = image_credentials(nobody_dump)
    assert len(found) == 2, f"one core image per thread: {sorted(found)}"
    for name, all_creds in found.items():
        assert len(all_creds) == 1, name
        (creds,) = all_creds
        ids = (creds.uid, creds.euid, creds.suid, creds.fsuid)
        gids = (creds.gid, creds.egid, creds.sgid, creds.fsgid)
        assert ids == gids == (NOBODY,) * 4, name
        for held in (creds.cap_inh, creds.cap_prm, creds.cap_eff, creds.cap_amb):
            assert held and not any(held), (name, held)
        assert any(creds.cap_bnd), "a normal process keeps the full bounding set"
        assert (creds.secbits, creds.groups) == (0, ())
    check_image_credentials(nobody_dump, AS_NOBODY)


def test_another_user_may_not_restore_nobodys_dump(nobody_dump: Path) -> None:
    cause = _refusal(nobody_dump, Caller(uid=1000, gid=1000, groups=frozenset({1000})))
    assert cause.startswith("core-")
    assert "would run as uid 65534 (euid 65534, suid 65534, fsuid 65534)" in cause
    assert cause.endswith("not as you (uid 1000)")


def test_a_dump_of_a_root_process_is_refused(root_dump: Path) -> None:
    ((name, (creds,)),) = image_credentials(root_dump).items()
    assert creds.uid == creds.euid == 0
    assert any(creds.cap_eff)
    expected = "the process would run as uid 0 (euid 0, suid 0, fsuid 0), not as you (uid 65534)"
    assert _refusal(root_dump) == f"{name}: {expected}"


# --- forged credentials -----------------------------------------------------------------


def test_a_forged_root_uid_decodes_as_criu_would_read_it(copy: Path) -> None:
    core = _first_core(copy)
    _forge_creds(core, _with_creds({UID: 0, EUID: 0}))
    (creds,) = image_credentials(copy)[core.name]
    assert (creds.uid, creds.euid, creds.suid, creds.fsuid) == (0, 0, NOBODY, NOBODY)
    assert creds.gid == NOBODY and not any(creds.cap_eff)
    assert _refusal(copy) == (
        f"{core.name}: the process would run as uid 0 (euid 0), not as you (uid 65534)"
    )


def test_full_capabilities_under_nobodys_uids_are_refused(copy: Path) -> None:
    core = _first_core(copy)
    _forge_creds(core, _with_creds({CAP_EFF: [0xFFFFFFFF, 0xFFFFFFFF]}))
    (creds,) = image_credentials(copy)[core.name]
    assert creds.uid == creds.euid == NOBODY
    assert _refusal(copy) == (
        f"{core.name}: the process would hold capabilities (cap_eff 0xffffffff 0xffffffff), "
        "and an unprivileged process holds none"
    )


@pytest.mark.parametrize(
    ("values", "packed", "named"),
    [
        ({FSUID: 0}, False, "would run as fsuid 0, not as you (uid 65534)"),
        ({SUID: 1000}, False, "would run as suid 1000, not as you"),
        ({EGID: 0}, False, "would run as egid 0, not in your group (gid 65534)"),
        ({GID: 0, FSGID: 0}, False, "would run as gid 0 (fsgid 0), not in your group"),
        ({GROUPS: [65534, 0, 27]}, True, "supplementary groups 0, 27, which you are not in"),
        ({GROUPS: [0]}, False, "supplementary groups 0, which"),
        ({CAP_PRM: [1 << 21, 0]}, False, "capabilities (cap_prm 0x00200000 0x00000000)"),
        ({CAP_INH: [0, 1]}, True, "capabilities (cap_inh 0x00000000 0x00000001)"),
        ({CAP_AMB: [1, 0]}, False, "capabilities (cap_amb 0x00000001 0x00000000)"),
        ({SECBITS: 0x2F}, False, "would run with securebits 0x2f"),
        # protobuf-c keeps the low 32 bits, so CRIU would read uid 0
        ({UID: 1 << 32}, False, "no 32-bit number"),
    ],
    ids=[
        "fsuid", "suid", "egid", "gid", "groups-packed", "groups", "cap_prm", "cap_inh",
        "cap_amb", "secbits", "uid-past-32-bits",
    ],
)  # fmt: skip
def test_forged_credentials_are_refused_by_name(
    copy: Path, values: dict[int, int | list[int]], packed: bool, named: str
) -> None:
    core = _first_core(copy)
    _forge_creds(core, _with_creds(values, packed))
    cause = _refusal(copy)
    assert cause.startswith(f"{core.name}: ")
    assert named in cause


def test_groups_the_caller_has_are_accepted(copy: Path) -> None:
    _forge_creds(_first_core(copy), _with_creds({GROUPS: [27, NOBODY]}, packed=True))
    check_image_credentials(copy, Caller(uid=NOBODY, gid=NOBODY, groups=frozenset({27})))
    assert "supplementary groups 27" in _refusal(copy)


def test_a_second_creds_message_that_protobuf_would_merge_in_is_checked(copy: Path) -> None:
    core = _first_core(copy)

    def add_creds_claiming_root(thread_core: bytes) -> bytes:
        ((creds_field,),) = [[f] for n, f in _split(thread_core) if n == CREDS]
        root = _with_creds({UID: 0, EUID: 0, SUID: 0, FSUID: 0})(_payload(creds_field))
        return thread_core + _message_field(CREDS, root)

    _forge_thread_core(core, add_creds_claiming_root)
    assert [creds.uid for creds in image_credentials(copy)[core.name]] == [NOBODY, 0]
    assert "would run as uid 0" in _refusal(copy)


# --- images that cannot vouch for their credentials -------------------------------------


@pytest.mark.parametrize(
    ("forge", "named"),
    [
        (lambda core: _forge_thread_core(core, _without(CREDS)), "has no thread_core.creds"),
        (lambda core: _forge_core_entry(core, _without(THREAD_CORE)), "no thread_core.creds"),
        (lambda core: _forge_creds(core, _without(EUID)), "has creds without euid"),
        (lambda core: core.write_bytes(core.read_bytes()[:-7]), "is truncated"),
        (lambda core: core.write_bytes(core.read_bytes()[:10]), "is truncated"),
        (lambda core: core.write_bytes(core.read_bytes()[:5]), "is truncated"),
        (lambda core: core.write_bytes(core.read_bytes() + b"\0\0"), "is truncated"),
        (lambda core: core.write_bytes(core.read_bytes() + core.read_bytes()[8:]),
         "holds 2 entries where a core image holds one"),
        (lambda core: core.write_bytes((core.parent / "pstree.img").read_bytes()),
         "is not a CRIU core image (magic 0x54564319 0x50273030"),
        (lambda core: shutil.copy(core.parent / "inventory.img", core), "not a CRIU core image"),
    ],
    ids=[
        "no-creds", "no-thread-core", "no-euid", "cut-mid-entry", "cut-in-length",
        "cut-in-header", "trailing-bytes", "two-entries", "pstree-magic", "inventory",
    ],
)  # fmt: skip
def test_undecodable_core_images_are_refused(
    copy: Path, forge: Callable[[Path], object], named: str
) -> None:
    core = _first_core(copy)
    forge(core)
    cause = _refusal(copy)
    assert cause.startswith(f"{core.name}: ")
    assert named in cause


def test_a_link_in_place_of_a_core_image_is_not_followed(copy: Path) -> None:
    core = _first_core(copy)
    target = copy.parent / "elsewhere.img"
    core.rename(target)
    core.symlink_to(target)
    assert "cannot be opened" in _refusal(copy)


def test_a_fifo_in_place_of_a_core_image_is_refused_without_blocking(copy: Path) -> None:
    core = _first_core(copy)
    core.unlink()
    os.mkfifo(core)
    assert _refusal(copy) == f"{core.name}: is not a regular file"


def test_a_directory_without_core_images_is_refused(tmp_path: Path) -> None:
    assert "holds no core-*.img" in _refusal(tmp_path)
