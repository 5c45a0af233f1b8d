"""Which GPUs of this node a restored process goes onto: the GPU remap.

The driver restores a checkpointed process onto other GPUs when given ``gpuPairs`` (old UUID
-> new UUID). On driver 580 it needs a pair for every GPU the process can see: a single pair
0 -> 1 of a process seeing two GPUs returned CUDA_ERROR_INVALID_VALUE, while {0 -> 1, 1 -> 0}
worked. So a plan is always a full permutation of the process's GPUs.

``plan_targets`` is pure: it takes what the snapshot recorded and what this node has, and
either returns a plan or raises one ``NotReady``/``InvalidRequest`` that names the step, the
cause and what to do. Called by ``CudaCheckpointHook.preflight_restore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._constants import format_bytes
from ..core.errors import InvalidRequest, NotReady
from .inventory import GpuDevice

# GPU memory kept free beyond what a restored process needs (contexts grow a little).
GPU_MARGIN_BYTES = 256 << 20
# Longest ``gpus`` choice accepted; no node has more GPUs.
MAX_CHOSEN_GPUS = 64


@dataclass(frozen=True)
class SavedGpu:
    """A GPU the snapshot's process could see, at its position among the process's devices."""

    position: int  # cuda:<position> inside the process
    uuid: str
    name: str
    index: int  # its index (nvidia-smi) on the node of the save
    need: int  # bytes the process held on it


@dataclass(frozen=True)
class Placement:
    saved: SavedGpu
    target: GpuDevice

    @property
    def moved(self) -> bool:
        return self.saved.uuid != self.target.uuid

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": f"cuda:{self.saved.position}",
            "from": {"index": self.saved.index, "uuid": self.saved.uuid, "name": self.saved.name},
            "to": {"index": self.target.index, "uuid": self.target.uuid,
                   "name": self.target.name},
            "bytes": self.saved.need,
        }


@dataclass(frozen=True)
class GpuPlan:
    """Where each GPU the process could see goes; ``chosen`` when the user picked them."""

    placements: tuple[Placement, ...]
    chosen: bool = False

    @property
    def remapped(self) -> bool:
        return any(p.moved for p in self.placements)

    def pairs(self, uuids: Sequence[str] | None = None) -> list[tuple[str, str]]:
        """(old UUID, new UUID) for every GPU of ``uuids`` (default: all), or [] when none
        moves: the driver then restores onto the same GPUs without pairs."""
        if not self.remapped:
            return []
        wanted = set(uuids) if uuids is not None else None
        return [(p.saved.uuid, p.target.uuid) for p in self.placements
                if wanted is None or p.saved.uuid in wanted]

    def to_dict(self) -> dict[str, Any]:
        """What a restore result and the restored kernel's notice say about the GPUs."""
        found: dict[str, Any] = {"remapped": self.remapped, "chosen": self.chosen,
                                 "devices": [p.to_dict() for p in self.placements]}
        found["notice"] = remap_notice(found)
        return found


def parse_gpu_choice(value: object) -> list[str]:
    """``gpus`` as given to REST (a list of indices or UUIDs) or the CLI (``1,0``), checked
    for shape only; whether the GPUs fit is decided at restore, against this node."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(items) > MAX_CHOSEN_GPUS:
        raise InvalidRequest(
            "request", "gpus must be a non-empty list of GPU indices or UUIDs",
            hint="e.g. [1, 0] (or --gpus 1,0): cuda:0 of the process goes onto GPU 1, "
            "cuda:1 onto GPU 0",
        )
    chosen = []
    for item in items:
        text = str(item).strip() if isinstance(item, int | str) else ""
        if isinstance(item, bool) or not (
            text.isdigit() or (text.upper().startswith("GPU-") and len(text) <= 64)
        ):
            raise InvalidRequest(
                "request", f"gpus entry {item!r} is neither a GPU index nor a GPU UUID",
                hint="name GPUs as nvidia-smi does: 0, 1, ... or GPU-<uuid>",
            )
        chosen.append(text)
    return chosen


def visible_uuids(cuda_visible_devices: str | None, node: Sequence[GpuDevice]) -> list[str]:
    """The UUIDs a process sees, in the order of its devices (cuda:0 first).

    ``CUDA_VISIBLE_DEVICES`` lists indices or UUIDs (a unique prefix is enough); as CUDA
    does, the list ends at the first entry that names no GPU. Unset: every GPU, by index.
    """
    ordered = sorted(node, key=lambda d: d.index)
    if cuda_visible_devices is None:
        return [d.uuid for d in ordered]
    found: list[str] = []
    for item in cuda_visible_devices.split(","):
        text = item.strip()
        if text.isdigit():
            match = [d for d in ordered if d.index == int(text)]
        else:
            match = [d for d in ordered if text and d.uuid.lower().startswith(text.lower())]
        if len(match) != 1 or match[0].uuid in found:
            break
        found.append(match[0].uuid)
    return found


def saved_gpus(gpu: dict[str, Any]) -> list[SavedGpu]:
    """The GPUs the snapshot's processes could see, in the order of the process's devices.

    ``visible`` (UUIDs in cuda:N order) is recorded at save; snapshots without it saw every
    GPU of their node, in index order (no ``CUDA_VISIBLE_DEVICES``).
    """
    devices = {str(d["uuid"]): d for d in gpu.get("devices", [])}
    order = [str(u) for u in gpu.get("visible") or []]
    if not order:
        order = [str(d["uuid"]) for d in sorted(devices.values(), key=lambda d: int(d["index"]))]
    need: dict[str, int] = {}
    for proc in gpu.get("processes", []):
        for uuid, used in (proc.get("devices") or {}).items():
            need[uuid] = need.get(uuid, 0) + int(used)
            if uuid not in order:
                order.append(uuid)  # used but not recorded as visible: still moved with it
    return [
        SavedGpu(position, uuid, str(devices.get(uuid, {}).get("name", "unknown GPU")),
                 int(devices.get(uuid, {}).get("index", position)), need.get(uuid, 0))
        for position, uuid in enumerate(order)
    ]


def _room(device: GpuDevice, need: int) -> bool:
    return need == 0 or device.memory_free >= need + GPU_MARGIN_BYTES


def _describe(device: GpuDevice) -> str:
    return f"GPU {device.index} ({device.name}, {format_bytes(device.memory_free)} free)"


def plan_targets(
    sid: str,
    saved: Sequence[SavedGpu],
    node: Sequence[GpuDevice],
    chosen: Sequence[str] | None = None,
    *,
    remap_supported: bool = True,
) -> GpuPlan:
    """The target GPU of each saved one: the user's choice when given, else the same GPUs
    when present with room, else GPUs of the same model with room. Raises when none fits."""
    if chosen is not None:
        plan = _plan_chosen(sid, saved, node, chosen)
    else:
        plan = _plan_automatic(sid, saved, node)
    if plan.remapped and not remap_supported:
        raise NotReady(
            "preflight",
            f"snapshot {sid} must go onto other GPUs here "
            f"({_moves_text(plan)}), and this driver cannot restore onto other GPUs",
            hint="use NVIDIA driver 570 or newer, or restore on the node it was taken on",
        )
    return plan


def _moves_text(plan: GpuPlan) -> str:
    return ", ".join(f"cuda:{p.saved.position} from GPU {p.saved.index} to GPU {p.target.index}"
                     for p in plan.placements if p.moved)


def resolve_choice(item: str, node: Sequence[GpuDevice]) -> GpuDevice | None:
    """A GPU of this node named by its index (``1``) or its UUID (``GPU-8f3c...``)."""
    text = item.strip()
    if text.isdigit():
        return next((d for d in node if d.index == int(text)), None)
    return next((d for d in node if d.uuid.lower() == text.lower()), None)


def _plan_chosen(sid: str, saved: Sequence[SavedGpu], node: Sequence[GpuDevice],
                 chosen: Sequence[str]) -> GpuPlan:
    listing = "; ".join(f"{d.index}: {d.name} {d.uuid}" for d in node) or "none"
    if len(chosen) != len(saved):
        raise InvalidRequest(
            "preflight",
            f"gpus names {len(chosen)} GPU(s), but the process of snapshot {sid} could see "
            f"{len(saved)} ({', '.join(f'cuda:{s.position} = {s.name}' for s in saved)})",
            hint=f"give one GPU of this node per device of the process, in the order of its "
            f"devices (cuda:0 first); this node has {listing}",
        )
    # First whether the request names a permutation of this node's GPUs, then whether each fits.
    targets: list[GpuDevice] = []
    taken: dict[str, int] = {}
    for saved_gpu, item in zip(saved, chosen, strict=True):
        target = resolve_choice(str(item), node)
        if target is None:
            raise InvalidRequest(
                "preflight", f"gpus names {item!r} for cuda:{saved_gpu.position}, which is "
                "no GPU of this node",
                hint=f"name GPUs by index or UUID; this node has {listing}",
            )
        if target.uuid in taken:
            raise InvalidRequest(
                "preflight", f"gpus names GPU {target.index} for both cuda:{taken[target.uuid]}"
                f" and cuda:{saved_gpu.position}: it must be a permutation, one distinct GPU "
                "per device of the process",
                hint="name each GPU once",
            )
        taken[target.uuid] = saved_gpu.position
        targets.append(target)
    for saved_gpu, target in zip(saved, targets, strict=True):
        if target.name != saved_gpu.name:
            raise NotReady(
                "preflight", f"cuda:{saved_gpu.position} of snapshot {sid} was a "
                f"{saved_gpu.name}; GPU {target.index} chosen for it is a {target.name}",
                hint="choose GPUs of the same model: the driver restores a process only onto "
                "the GPU model it was checkpointed on",
            )
        if not _room(target, saved_gpu.need):
            raise NotReady(
                "preflight", f"GPU {target.index} chosen for cuda:{saved_gpu.position} has "
                f"{format_bytes(target.memory_free)} free; snapshot {sid} needs "
                f"{format_bytes(saved_gpu.need)} there",
                hint="choose a GPU with more free memory, or free memory on it and retry",
            )
    placements = [Placement(s, t) for s, t in zip(saved, targets, strict=True)]
    return GpuPlan(tuple(placements), chosen=True)


def _plan_automatic(sid: str, saved: Sequence[SavedGpu],
                    node: Sequence[GpuDevice]) -> GpuPlan:
    _require_model_counts(sid, saved, node)
    # GPUs the process used are placed first, largest first: the others fit anywhere.
    used = sorted((s for s in saved if s.need > 0), key=lambda s: (-s.need, s.position))
    homes = {s.uuid for s in used}

    def candidates(s: SavedGpu, free: set[str]) -> list[GpuDevice]:
        fits = [d for d in node if d.uuid in free and d.name == s.name and _room(d, s.need)]
        # Its own GPU first, then GPUs no other used device lives on, roomiest first.
        return sorted(fits, key=lambda d: (d.uuid != s.uuid, d.uuid in homes,
                                           -d.memory_free, d.index))

    def place(i: int, free: set[str]) -> dict[int, GpuDevice] | None:
        if i == len(used):
            return {}
        for device in candidates(used[i], free):
            rest = place(i + 1, free - {device.uuid})
            if rest is not None:
                return {used[i].position: device, **rest}
        return None

    assigned = place(0, {d.uuid for d in node})
    if assigned is None:
        raise NotReady("preflight", _no_room_cause(sid, used, node),
                       hint="free GPU memory (shut down other kernels), choose the GPUs with "
                       "gpus=, or restore on a node with more free GPU memory")
    free = {d.uuid for d in node} - {d.uuid for d in assigned.values()}
    for s in (s for s in saved if s.need == 0):
        fits = [d for d in node if d.uuid in free and d.name == s.name]
        target = min(fits, key=lambda d: (d.uuid != s.uuid, d.index))  # counts checked above
        assigned[s.position] = target
        free.discard(target.uuid)
    return GpuPlan(tuple(Placement(s, assigned[s.position]) for s in saved))


def _require_model_counts(sid: str, saved: Sequence[SavedGpu],
                          node: Sequence[GpuDevice]) -> None:
    wanted: dict[str, int] = {}
    for s in saved:
        wanted[s.name] = wanted.get(s.name, 0) + 1
    here: dict[str, int] = {}
    for d in node:
        here[d.name] = here.get(d.name, 0) + 1
    short = {name: n for name, n in wanted.items() if here.get(name, 0) < n}
    if not short:
        return
    has = ", ".join(f"{n} {name}" for name, n in sorted(here.items())) or "no GPU"
    raise NotReady(
        "preflight",
        f"the process of snapshot {sid} could see "
        + ", ".join(f"{n} {name} GPU(s)" for name, n in short.items())
        + f"; this node has {has}",
        hint="restore it on a node with as many GPUs of that model: the driver restores a "
        "process only onto the GPU model it was checkpointed on",
    )


def _no_room_cause(sid: str, used: Sequence[SavedGpu], node: Sequence[GpuDevice]) -> str:
    needs = ", ".join(f"cuda:{s.position} {format_bytes(s.need)}" for s in used)
    models = {s.name for s in used}
    have = "; ".join(_describe(d) for d in node if d.name in models)
    return (f"no choice of GPUs here has room for snapshot {sid}: its process needs {needs} "
            f"(plus {format_bytes(GPU_MARGIN_BYTES)} each), and this node's GPUs of its model "
            f"have {have}")


def remap_notice(remap: dict[str, Any] | None) -> str:
    """What the restored kernel, the CLI and the job say when a restore moved GPUs; '' when
    none moved. ``remap`` is ``GpuPlan.to_dict()``."""
    if not remap or not remap.get("remapped"):
        return ""
    moves = [
        f"{d['device']} from GPU {d['from']['index']} ({d['from']['uuid']}) to GPU "
        f"{d['to']['index']} ({d['to']['uuid']})"
        for d in remap.get("devices", []) if d["from"]["uuid"] != d["to"]["uuid"]
    ]
    return (
        "This kernel was restored onto other GPUs: " + "; ".join(moves) + ". Device numbers "
        "inside the kernel are unchanged. GPU UUIDs, NVML handles and PCI bus ids it read "
        "before the snapshot (pynvml, nvidia-smi output, cached device properties) still name "
        "the old GPUs: read them again."
    )


def describe_choice(sid: str, gpu: dict[str, Any] | None, node: Sequence[GpuDevice],
                    chosen: Sequence[str] | None, remap_supported: bool) -> dict[str, Any]:
    """What a restore of the snapshot would do with its GPUs here, for a client to show
    before it asks: the node's GPUs, the process's devices, and the plan or the refusal."""
    saved = saved_gpus(gpu) if gpu and gpu.get("processes") else []
    found: dict[str, Any] = {
        "node": [d.to_dict() for d in sorted(node, key=lambda d: d.index)],
        "devices": [{"device": f"cuda:{s.position}", "uuid": s.uuid, "name": s.name,
                     "index": s.index, "bytes": s.need} for s in saved],
        "remap_supported": remap_supported,
        "plan": None,
        "problem": None,
    }
    if not saved and chosen is not None:
        found["problem"] = InvalidRequest(
            "preflight", f"gpus was given, but snapshot {sid} holds no CUDA state to place",
            hint="restore it without gpus").to_dict()
    if saved:
        try:
            found["plan"] = plan_targets(sid, saved, node, chosen,
                                         remap_supported=remap_supported).to_dict()
        except (InvalidRequest, NotReady) as exc:
            found["problem"] = exc.to_dict()
    return found
