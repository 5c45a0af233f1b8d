"""The copies a timeline point keeps of the values a cell changed.

Every changed name's new value is deep-copied, all with ONE memo per point, so objects the
values share (a model and the optimizer that holds its parameters) stay shared among the
copies. Device arrays are copied where they live (a PyTorch tensor's deepcopy clones it on
its device, a CuPy array's copy stays on its GPU); JAX arrays and modules are immutable or
global and are kept by reference. What cannot be copied (open files, sockets, generators,
threads, locks, anything deepcopy raises on) is kept as the reason, in words.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..portable import refusal
from .fingerprint import (
    is_cupy_array,
    is_jax_array,
    is_numpy_array,
    is_pandas_object,
    is_torch_module,
    is_torch_tensor,
)
from .limits import ENV_GPU_COPIES, gpu_copies_by_env

_SIZE_DEPTH = 6
# What copy.deepcopy does not copy.
_SHARED_BY_COPIES = (type(None), bool, int, float, complex, str, bytes, range, type,
                     types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_SIZE_ITEMS = 10_000


@dataclass(frozen=True)
class Entry:
    """What a point knows of one name after its cell.

    ``kind``: "copy" (``value`` is a private copy), "reference" (``value`` is the object
    itself: a module, a JAX array), "uncopied" (``reason`` says why) or "absent" (the name
    did not exist). ``live_id`` is the id the name's value had then: names with the same
    one were bound to one object.
    """

    kind: str
    value: Any = None
    live_id: int = 0
    nbytes: int = 0
    reason: str = ""


ABSENT = Entry("absent")


def size_of(value: Any, devices: dict[str, int] | None = None) -> int:
    """About how many bytes a copy of ``value`` takes (host and device), by a bounded walk;
    ``devices`` gets the bytes it would take on each GPU ("cuda:0": bytes)."""
    return _size(value, 0, set(), {} if devices is None else devices)


def _size(value: Any, depth: int, seen: set[int], devices: dict[str, int]) -> int:
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if is_numpy_array(value):
        return int(value.nbytes)
    if is_torch_tensor(value):
        grad = value.grad if value.is_leaf else None
        own = int(value.nelement() * value.element_size())
        if value.device.type != "cpu":
            where = str(value.device)
            devices[where] = devices.get(where, 0) + own
        return own + (_size(grad, depth, seen, devices) if grad is not None else 0)
    if is_jax_array(value):
        return 0  # kept by reference
    if is_cupy_array(value):
        where = f"cuda:{getattr(value.device, 'id', 0)}"
        devices[where] = devices.get(where, 0) + int(value.nbytes)
        return int(value.nbytes)
    if is_pandas_object(value):
        usage = value.memory_usage(deep=False, index=True) if hasattr(value, "memory_usage") \
            else 0
        return int(getattr(usage, "sum", lambda: usage)())
    if isinstance(value, _SHARED_BY_COPIES):
        return 0  # deepcopy keeps the object itself: a copy costs nothing
    size = sys.getsizeof(value, 64)
    if depth >= _SIZE_DEPTH:
        return size
    items: list[Any]
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        every = [*value.values(), *value] if isinstance(value, dict) else list(value)
        items = every[:_SIZE_ITEMS]
        if len(every) > len(items):  # the rest taken to be like the first ones
            sampled = sum(_size(item, depth + 1, seen, devices) for item in items)
            return size + sampled * len(every) // len(items)
    else:
        inside = getattr(value, "__dict__", None)
        items = [inside] if isinstance(inside, dict) else []
        if is_torch_module(value):
            # However deep the model: every parameter and buffer.
            items += [*value.parameters(), *value.buffers()]
    return size + sum(_size(item, depth + 1, seen, devices) for item in items)


def _short_of_gpu_memory(devices: dict[str, int]) -> str | None:
    """Why copying this much onto its GPUs would not leave enough free, or None. A copy
    leaves a quarter of each GPU free, so that the user's next cell does not run out."""
    torch = sys.modules.get("torch")
    for where, nbytes in devices.items():
        try:
            if torch is not None and torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info(torch.device(where))
            else:
                cupy = sys.modules.get("cupy")
                if cupy is None:
                    continue
                with cupy.cuda.Device(int(where.partition(":")[2] or 0)):
                    free, total = cupy.cuda.runtime.memGetInfo()
        except Exception:
            continue  # not known: copied, as far as the device lets it
        if nbytes > free - total // 4:
            return (f"its copy on {where} ({_mib(nbytes)}) would leave too little GPU "
                    f"memory ({_mib(free)} free)")
    return None


def _by_reference(value: Any) -> bool:
    return isinstance(value, (types.ModuleType, type, types.FunctionType,
                              types.BuiltinFunctionType)) or is_jax_array(value)


class Recycled:
    """Big NumPy copies the timeline let go of, whose memory the next copies of the same
    shape reuse: fresh memory costs the first write of every page, often more than the
    copy itself. Held only while one point is taken."""

    def __init__(self) -> None:
        self.arrays: list[Any] = []

    def give(self, entry: Entry | None) -> None:
        if entry is None:
            return
        value: Any = entry.value
        if entry.kind == "copy" and is_numpy_array(value) \
                and value.nbytes >= _RECYCLED_MIN_BYTES and value.flags.c_contiguous \
                and value.flags.owndata and not value.dtype.hasobject:
            self.arrays.append(value)

    def take(self, like: Any) -> Any:
        """A let-go array shaped like ``like`` that nothing else holds, or None."""
        for index in range(len(self.arrays)):  # enumerate's tuple would hold one more
            array = self.arrays[index]
            # Held by this list, this variable and the call's argument only: no entry
            # still holds it.
            if array.shape == like.shape and array.dtype == like.dtype \
                    and sys.getrefcount(array) <= _UNHELD_REFCOUNT:
                return self.arrays.pop(index)
        return None


_RECYCLED_MIN_BYTES = 1 << 20
# The list's reference, the variable and getrefcount's argument.
_UNHELD_REFCOUNT = 3


def copy_point(namespace: dict[str, Any], names: list[str], keep: dict[int, Any],
               limit_bytes: int, recycled: Recycled | None = None) -> dict[str, Entry]:
    """Entries for ``names`` as they are in ``namespace`` now, copied with one memo.

    ``keep`` holds objects (by id) that are kept by reference wherever met: modules and
    JAX arrays the fingerprint walk found. A copy that would pass ``limit_bytes`` is not
    taken. ``recycled``: memory to copy big arrays into.
    """
    memo: dict[int, Any] = {key: value for key, value in keep.items()}
    entries: dict[str, Entry] = {}
    for name in names:
        if name not in namespace:
            entries[name] = ABSENT
            continue
        value = namespace[name]
        entries[name] = _entry(value, memo, limit_bytes, recycled)
    return entries


def _entry(value: Any, memo: dict[int, Any], limit_bytes: int,
           recycled: Recycled | None = None) -> Entry:
    if _by_reference(value):
        return Entry("reference", value, id(value))
    refused = refusal(type(value))
    if refused:
        return Entry("uncopied", live_id=id(value), reason=f"{refused} cannot be copied")
    devices: dict[str, int] = {}
    nbytes = size_of(value, devices)
    if devices and not gpu_copies_by_env():
        return Entry("uncopied", live_id=id(value),
                     reason=f"it is on a GPU, and the timeline copies nothing there unless "
                     f"{ENV_GPU_COPIES}=on")
    short = _short_of_gpu_memory(devices) if devices else None
    if short:
        return Entry("uncopied", live_id=id(value), reason=short)
    if nbytes > limit_bytes:
        return Entry("uncopied", live_id=id(value),
                     reason=f"its copy ({_mib(nbytes)}) would pass the timeline's memory "
                     f"limit ({_mib(limit_bytes)})")
    known = len(memo)
    reused = None
    if recycled is not None and is_numpy_array(value) and type(value).__name__ == "ndarray" \
            and value.flags.c_contiguous and id(value) not in memo:
        reused = recycled.take(value)
    if reused is not None:
        reused[...] = value
        memo[id(value)] = reused
        return Entry("copy", reused, id(value), nbytes)
    try:
        copied = _copy(value, memo)
    except Exception as exc:
        # A copy that failed half way must not leave its half-made parts in the memo,
        # where another name sharing them would pick them up.
        for key in list(memo)[known:]:
            memo.pop(key, None)
        return Entry("uncopied", live_id=id(value), reason=_copy_failure(exc))
    return Entry("copy", copied, id(value), nbytes)


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    if is_cupy_array(value):
        copied = value.copy()  # on the array's own device
        memo[id(value)] = copied
        return copied
    return copy.deepcopy(value, memo)


def _copy_failure(exc: BaseException) -> str:
    text = str(exc)
    for word, words in (("TextIOWrapper", "an open file"), ("BufferedReader", "an open file"),
                        ("BufferedWriter", "an open file"), ("socket", "a socket"),
                        ("generator", "a generator"), ("_thread.lock", "a lock or a thread"),
                        ("_thread.RLock", "a lock or a thread"), ("coroutine", "a coroutine"),
                        ("frame", "a running frame")):
        if word in text:
            return f"it holds {words}, which cannot be copied"
    text = f"{type(exc).__name__}: {text}"
    return "it cannot be copied: " + (text if len(text) <= 200 else text[:197] + "...")


def fresh_copy(value: Any, memo: dict[int, Any]) -> Any:
    """A new copy of a point's stored copy (the point keeps its own)."""
    return _copy(value, memo)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
