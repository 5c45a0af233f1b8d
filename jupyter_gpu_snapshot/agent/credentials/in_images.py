"""Refuses a CRIU image whose threads would not run as the caller, unprivileged.

The node agent runs ``criu restore`` as root for unprivileged callers, and CRIU gives every
restored thread the credentials written in the thread's core image: uids, gids,
supplementary groups, capabilities and securebits. A caller could hand root an image that
claims root's or another user's credentials, or capabilities, and get a process holding
them. Before any restore the agent calls :func:`check_image_credentials`, which decodes the
credentials of every ``core-<tid>.img`` and refuses the image unless they are exactly the
caller's, with no capabilities.

Where CRIU keeps them: each thread's ``core_entry.thread_core.creds`` (images/core.proto,
images/creds.proto). An image without them is refused, because CRIU then either leaves the
thread with its own (root) credentials or reads them from an old-format ``creds-<pid>.img``.

What this check cannot see, and the agent must do itself:

- check the very files that criu will read, where the caller cannot change them (the
  agent's store is root's alone);
- run criu with the caller's groups only (``criu_runs_as``): a thread whose image
  lists none keeps criu's own, as CRIU calls setgroups only for a non-empty list;
- images with a user namespace, whose ids are relative to it, and LSM labels
  (``lsm_profile``), which root may set to any context, are not judged here.

The images are decoded by ``criu_wire``: only what is needed, with the standard library,
refusing whatever protobuf-c (CRIU's decoder) might read differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidRequest
from .criu_wire import (
    CORE_MAGIC,
    VARINT,
    MalformedImage,
    fields,
    image_entries,
    messages,
    read_image,
    uint32,
    varint,
)

# A core image is a few kilobytes. The agent reads files that the caller wrote, so it reads
# no more than this (a caller could name a huge file).
_MAX_IMAGE_BYTES = 16 << 20

# Field numbers, from CRIU's images/core.proto and images/creds.proto.
_CORE_ENTRY_THREAD_CORE = 5
_THREAD_CORE_CREDS = 10
_CREDS_SCALARS = {
    1: "uid", 2: "gid", 3: "euid", 4: "egid", 5: "suid", 6: "sgid", 7: "fsuid", 8: "fsgid",
    13: "secbits",
}  # fmt: skip
_CREDS_LISTS = {
    9: "cap_inh", 10: "cap_prm", 11: "cap_eff", 12: "cap_bnd", 14: "groups", 19: "cap_amb",
}  # fmt: skip

_CAPABILITY_SETS = ("cap_inh", "cap_prm", "cap_eff", "cap_amb")

_HINT = (
    "the node agent restores only images of your own unprivileged processes: dump a process "
    "that runs as you, with no capabilities"
)


@dataclass(frozen=True)
class Caller:
    """The unprivileged user asking for a restore, as the agent knows them."""

    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups the caller legitimately has


@dataclass(frozen=True)
class Creds:
    """One thread's credentials as its core image gives them to CRIU.

    The capability sets are tuples of 32-bit words, lowest capabilities first; ``cap_amb``
    is empty in images that predate ambient capabilities.
    """

    uid: int
    gid: int
    euid: int
    egid: int
    suid: int
    sgid: int
    fsuid: int
    fsgid: int
    cap_inh: tuple[int, ...]
    cap_prm: tuple[int, ...]
    cap_eff: tuple[int, ...]
    cap_bnd: tuple[int, ...]
    cap_amb: tuple[int, ...]
    secbits: int
    groups: tuple[int, ...]


def image_credentials(images_dir: Path) -> dict[str, list[Creds]]:
    """The credentials in each ``core-*.img`` of ``images_dir``, by file name.

    A file normally holds one ``Creds``; it holds more only where the creds message is
    repeated, which protobuf merges into one (so every copy must pass). Raises
    :class:`InvalidRequest` for a file that cannot be decoded.
    """
    found: dict[str, list[Creds]] = {}
    for path in sorted(images_dir.glob("core-*.img")):
        try:
            found[path.name] = _decode_core_image(read_image(path, _MAX_IMAGE_BYTES))
        except MalformedImage as error:
            raise _refusal(f"{path.name}: {error}") from None
    return found


def check_image_credentials(images_dir: Path, caller: Caller) -> None:
    """Raises :class:`InvalidRequest` unless every thread in the image runs as ``caller``.

    That is: all four uids are the caller's uid, all four gids the caller's gid, every
    supplementary group one the caller has, no capability in the inheritable, permitted,
    effective or ambient sets, and no securebits.
    """
    found = image_credentials(images_dir)
    if not found:
        raise _refusal(f"{images_dir} holds no core-*.img, so it is no CRIU image")
    for name, all_creds in found.items():
        for creds in all_creds:
            problem = _why_not_the_callers(creds, caller)
            if problem:
                raise _refusal(f"{name}: {problem}")


def _refusal(cause: str) -> InvalidRequest:
    return InvalidRequest("restore", cause, hint=_HINT)


def _why_not_the_callers(creds: Creds, caller: Caller) -> str | None:
    uids = {"uid": creds.uid, "euid": creds.euid, "suid": creds.suid, "fsuid": creds.fsuid}
    wrong_uids = [(name, value) for name, value in uids.items() if value != caller.uid]
    if wrong_uids:
        return f"the process would run as {_listed(wrong_uids)}, not as you (uid {caller.uid})"

    gids = {"gid": creds.gid, "egid": creds.egid, "sgid": creds.sgid, "fsgid": creds.fsgid}
    wrong_gids = [(name, value) for name, value in gids.items() if value != caller.gid]
    if wrong_gids:
        return (
            f"the process would run as {_listed(wrong_gids)}, not in your group (gid {caller.gid})"
        )

    foreign_groups = sorted(set(creds.groups) - caller.groups - {caller.gid})
    if foreign_groups:
        listed = ", ".join(str(group) for group in foreign_groups)
        return f"the process would be in supplementary groups {listed}, which you are not in"

    held = [
        f"{name} " + " ".join(f"{word:#010x}" for word in getattr(creds, name))
        for name in _CAPABILITY_SETS
        if any(getattr(creds, name))
    ]
    if held:
        return (
            f"the process would hold capabilities ({'; '.join(held)}), "
            "and an unprivileged process holds none"
        )

    # Setting securebits needs CAP_SETPCAP, and CRIU sets the image's bits while it still
    # has root's capabilities, so an image could hand the caller bits they never had. Any
    # bit can mislead a setuid-root program the process runs: NO_SETUID_FIXUP or KEEP_CAPS
    # keep its capabilities when it drops to the caller's uid, NOROOT leaves it without the
    # CAP_SETUID it needs to drop its saved uid. An unprivileged process has bits only when
    # a privileged ancestor set them (systemd's SecureBits=); such images are refused too.
    if creds.secbits:
        return (
            f"the process would run with securebits {creds.secbits:#x}, "
            "which only a privileged process can set"
        )
    return None


def _listed(wrong: list[tuple[str, int]]) -> str:
    """``uid 0 (euid 0, suid 0)``: the first field that is wrong, then the others."""
    (first_name, first_value), *others = wrong
    text = f"{first_name} {first_value}"
    if others:
        text += " (" + ", ".join(f"{name} {value}" for name, value in others) + ")"
    return text


def _decode_core_image(data: bytes) -> list[Creds]:
    entries = image_entries(data, CORE_MAGIC, "core")
    # CRIU writes one core_entry and reads only the first: a second would be a place to
    # hide what CRIU reads, so none is accepted.
    if len(entries) != 1:
        raise MalformedImage(f"holds {len(entries)} entries where a core image holds one")
    creds = [
        _decode_creds(creds_message)
        for thread_core in messages(entries[0], _CORE_ENTRY_THREAD_CORE)
        for creds_message in messages(thread_core, _THREAD_CORE_CREDS)
    ]
    if not creds:
        raise MalformedImage(
            "has no thread_core.creds: CRIU would leave the thread with its own (root) "
            "credentials or read them from elsewhere"
        )
    return creds


def _decode_creds(message: bytes) -> Creds:
    scalars: dict[str, int] = {}
    lists: dict[str, list[int]] = {name: [] for name in _CREDS_LISTS.values()}
    for number, wire_type, value in fields(message):
        if number in _CREDS_SCALARS:
            if wire_type != VARINT:
                raise MalformedImage(f"has creds.{_CREDS_SCALARS[number]} in the wrong encoding")
            # A later copy of a field replaces an earlier one, as in protobuf.
            scalars[_CREDS_SCALARS[number]] = uint32(value)
        elif number in _CREDS_LISTS:
            words = lists[_CREDS_LISTS[number]]
            if wire_type == VARINT:  # a repeated field written one value at a time
                words.append(uint32(value))
            elif isinstance(value, bytes):  # packed: the values back to back, no keys
                position = 0
                while position < len(value):
                    word, position = varint(value, position)
                    words.append(uint32(word))
            else:
                raise MalformedImage(f"has creds.{_CREDS_LISTS[number]} in the wrong encoding")
    # Required in creds.proto: protobuf-c refuses a creds message without them, so CRIU
    # would too; refusing here keeps the two in step.
    missing = [name for name in _CREDS_SCALARS.values() if name not in scalars]
    if missing:
        raise MalformedImage(f"has creds without {', '.join(missing)}")
    return Creds(
        uid=scalars["uid"], gid=scalars["gid"], euid=scalars["euid"], egid=scalars["egid"],
        suid=scalars["suid"], sgid=scalars["sgid"],
        fsuid=scalars["fsuid"], fsgid=scalars["fsgid"],
        cap_inh=tuple(lists["cap_inh"]), cap_prm=tuple(lists["cap_prm"]),
        cap_eff=tuple(lists["cap_eff"]), cap_bnd=tuple(lists["cap_bnd"]),
        cap_amb=tuple(lists["cap_amb"]),
        secbits=scalars["secbits"], groups=tuple(lists["groups"]),
    )  # fmt: skip


