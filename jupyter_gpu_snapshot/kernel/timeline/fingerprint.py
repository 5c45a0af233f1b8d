"""Cheap fingerprints of the user's values: what tells the timeline a name changed.

A fingerprint is a number computed by a bounded walk of a value. Two fingerprints of one
name differ when the name was rebound or the walk saw the value change in place:

- PyTorch tensors by identity, data pointer and ``_version`` (which every in-place
  operation bumps), their ``.grad`` likewise; JAX arrays are immutable, so identity is
  enough; CuPy arrays by identity and pointer only (their contents are not read: an
  in-place change of one is not seen).
- NumPy arrays and pandas objects by a blake3 digest of their buffers. A big buffer is
  digested again only when the cell could reach it (``Walk.deep``): otherwise its last
  digest is reused, which is what keeps a cell that touches nothing big cheap.
- Lists, tuples, dicts, sets by the identities of their items, and a few levels into the
  items; objects by their ``__dict__`` (or slots); modules, functions, classes by identity.

Frameworks are looked at only if the user already imported them (``sys.modules``); nothing
here imports torch, numpy, pandas, cupy or jax. What a walk cannot judge (a C object whose
insides it cannot read, a container too big to walk in full) is named in ``Walk.unseen``,
never claimed exact.
"""

from __future__ import annotations

import datetime
import decimal
import fractions
import pathlib
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import blake3

MAX_DEPTH = 4
# Items whose identities enter a container's fingerprint, and those walked further.
MAX_ITEMS = 100_000
MAX_WALKED_ITEMS = 1_000
# Buffers up to this size are digested at every cell; bigger ones only when reachable.
SMALL_BUFFER_BYTES = 4 << 20
_THREADED_BYTES = 16 << 20

_IMMUTABLE = (
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis),
    type(NotImplemented), datetime.date, datetime.time, datetime.timedelta,
    datetime.timezone, decimal.Decimal, fractions.Fraction, pathlib.PurePath, re.Pattern,
)
_BY_IDENTITY = (
    types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
    types.MethodType, types.CodeType, property, staticmethod, classmethod,
)

_BY_IDENTITY_ALONE = (*_IMMUTABLE, *_BY_IDENTITY)


def digest_buffer(buffer: Any) -> bytes:
    """blake3 of a contiguous buffer, over several threads when it is big."""
    size = memoryview(buffer).nbytes
    threads = blake3.blake3.AUTO if size >= _THREADED_BYTES else 1
    return blake3.blake3(buffer, max_threads=threads).digest(16)


def _module_of(value: Any) -> str:
    return type(value).__module__ or ""


def _loaded_class(module: str, path: str) -> type | None:
    """``module.path`` when that module is loaded and it is a class: a module of that name
    that is something else (a stand-in, one half imported) is not the library."""
    found: Any = sys.modules.get(module)
    for part in path.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def is_torch_tensor(value: Any) -> bool:
    tensor = _loaded_class("torch", "Tensor")
    return tensor is not None and isinstance(value, tensor)


def is_torch_module(value: Any) -> bool:
    module = _loaded_class("torch", "nn.Module")
    return module is not None and isinstance(value, module)


def is_numpy_array(value: Any) -> bool:
    array = _loaded_class("numpy", "ndarray")
    return array is not None and isinstance(value, array)


def is_jax_array(value: Any) -> bool:
    return _module_of(value).startswith(("jaxlib", "jax")) and hasattr(value, "block_until_ready")


def is_cupy_array(value: Any) -> bool:
    return _module_of(value).startswith("cupy") and hasattr(value, "data") \
        and hasattr(value, "shape")


def is_pandas_object(value: Any) -> bool:
    return "pandas" in sys.modules and _module_of(value).startswith("pandas") \
        and hasattr(value, "_mgr")


class Walk:
    """One cell's fingerprinting: the digests it reuses and what it could not judge.

    ``digests`` maps an array's (id, pointer, shape, strides, dtype) to its last digest,
    kept from cell to cell by the timeline. ``deep`` says whether big buffers met now are
    digested again (the name is one the cell could reach).
    """

    def __init__(self, digests: dict[tuple[Any, ...], bytes]) -> None:
        self.digests = digests
        self.fresh: dict[tuple[Any, ...], bytes] = {}
        self.unseen: dict[str, str] = {}
        self.deep = True
        self._name = ""
        self.by_reference: dict[int, Any] = {}
        self.touched_roots: set[int] = set()

    def name(self, name: str, value: Any, deep: bool) -> int:
        """The fingerprint of the user's name ``name`` bound to ``value``."""
        self._name = name
        self.deep = deep
        try:
            return hash(self._value(value, 0))
        except Exception as exc:  # an object whose attributes raise, say
            self._miss(f"it could not be looked into ({type(exc).__name__}: {exc})")
            return hash((id(value), "unjudged"))

    def _miss(self, why: str) -> None:
        self.unseen.setdefault(self._name, why)

    def _value(self, value: Any, depth: int) -> Any:
        kind = _KINDS.get(type(value)) or _kind_of(value)
        if kind == "identity":
            return id(value)
        if kind == "reference":
            self.by_reference[id(value)] = value
            return id(value)
        if kind == "numpy":
            return self._array(value)
        if kind == "torch":
            return self._tensor(value)
        if kind == "torch_module":
            return self._torch_module(value, depth)
        if kind == "cupy":
            self._miss("a CuPy array's contents are not read: an in-place change is not seen")
            return (id(value), int(getattr(value.data, "ptr", 0)))
        if kind == "pandas":
            return self._pandas(value, depth)
        if kind == "buffer":
            return (id(value), digest_buffer(value))
        if depth >= MAX_DEPTH:
            self._miss("nested deeper than the timeline looks")
            return id(value)
        if kind == "items":
            return self._items(value, list(value), depth)
        if kind == "mapping":
            return self._mapping(value, depth)
        return self._object(value, depth)

    def _items(self, value: Any, items: list[Any], depth: int) -> Any:
        if len(items) > MAX_ITEMS:
            self._miss(f"a container of {len(items)} items is checked in part")
            items = items[:MAX_ITEMS]
        return (id(value), len(items), hash(tuple(map(id, items))),
                self._walk_items(items, depth))

    def _walk_items(self, items: list[Any], depth: int) -> Any:
        """The items' own fingerprints, unless all are judged by identity already."""
        head = items[:MAX_WALKED_ITEMS]
        if set(map(type, head)) <= _IDENTITY_TYPES:  # at C speed: ints, strings...
            return None
        return tuple(self._value(item, depth + 1) for item in head)

    def _mapping(self, value: dict[Any, Any], depth: int) -> Any:
        keys = list(value)
        if len(keys) > MAX_ITEMS:
            self._miss(f"a mapping of {len(keys)} items is checked in part")
            keys = keys[:MAX_ITEMS]
        values = [value[key] for key in keys]
        return (id(value), len(value), hash(tuple(map(id, keys))),
                hash(tuple(map(id, values))), self._walk_items(values, depth))

    def _object(self, value: Any, depth: int) -> Any:
        inside = getattr(value, "__dict__", None)
        slots = _slot_values(value)
        if isinstance(inside, dict):
            return (id(value), self._mapping(inside, depth), slots and self._value(slots, depth))
        if slots is not None:
            return (id(value), self._value(slots, depth))
        if not callable(value):
            self._miss(f"a {type(value).__qualname__}'s insides cannot be read")
        return id(value)

    def _array(self, array: Any) -> Any:
        key = (id(array), array.__array_interface__["data"][0], array.shape, array.strides,
               array.dtype.str)
        # Views share their memory with their base: one digested again makes the others
        # digested again too (the names the cell reaches are walked first).
        root = root_array(array)
        if self.deep:
            self.touched_roots.add(id(root))
        if array.nbytes <= SMALL_BUFFER_BYTES or self.deep or key not in self.digests \
                or id(root) in self.touched_roots:
            digest = self.fresh.get(key)
            if digest is None:
                digest = _numpy_digest(array)
                self.fresh[key] = digest
        else:
            digest = self.fresh.get(key) or self.digests[key]
            self.fresh[key] = digest
        if array.dtype.hasobject:
            self._miss("an object array's items are checked by identity only")
        return (key, digest)

    def _tensor(self, tensor: Any) -> Any:
        grad = tensor.grad if tensor.is_leaf else None
        return (id(tensor), tensor.data_ptr(), tensor._version, tuple(tensor.shape),
                str(tensor.dtype), grad is not None and self._tensor(grad))

    def _torch_module(self, module: Any, depth: int) -> Any:
        """A model however deep: every parameter and buffer, each module's mode, and the
        top module's own attributes."""
        tensors = tuple(self._tensor(tensor) for tensor in
                        (*module.parameters(), *module.buffers()))
        modes = tuple(sub.training for sub in module.modules())
        own = [(key, item) for key, item in vars(module).items() if not key.startswith("_")]
        attributes = tuple((key, self._value(item, depth + 1)) for key, item in own)
        return (id(module), tensors, modes, attributes)

    def _pandas(self, value: Any, depth: int) -> Any:
        manager = value._mgr
        arrays = getattr(manager, "arrays", None)
        if arrays is None:
            arrays = [manager.array] if hasattr(manager, "array") else []
        parts: list[Any] = [id(value), id(manager)]
        for array in arrays:
            parts.append(self._pandas_array(array))
        for axis in ("index", "columns"):
            index = getattr(value, axis, None)
            if index is not None and index is not value:
                parts.append(id(index))
        return tuple(parts)

    def _pandas_array(self, array: Any) -> Any:
        if is_numpy_array(array):
            return self._array(array)
        for inner in ("_ndarray", "_codes", "_data"):
            held = getattr(array, inner, None)
            if is_numpy_array(held):
                return (id(array), self._array(held))
        if hasattr(array, "_pa_array"):  # Arrow arrays do not change in place
            return (id(array), id(array._pa_array))
        self._miss(f"a pandas {type(array).__qualname__} is checked by identity only")
        return id(array)


# What each type's values are fingerprinted as, learned once per type.
_KINDS: dict[type, str] = {}
_IDENTITY_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _kind_of(value: Any) -> str:
    kind = type(value)
    if isinstance(value, types.ModuleType) or is_jax_array(value):
        found = "reference"
    elif isinstance(value, _BY_IDENTITY_ALONE):
        found = "identity"
    elif is_numpy_array(value):
        found = "numpy"
    elif is_torch_tensor(value):
        found = "torch"
    elif is_torch_module(value):
        found = "torch_module"
    elif is_cupy_array(value):
        found = "cupy"
    elif is_pandas_object(value):
        found = "pandas"
    elif isinstance(value, (list, tuple, set, frozenset)) or kind.__name__ == "deque":
        found = "items"
    elif isinstance(value, dict):
        found = "mapping"
    elif isinstance(value, (bytearray, memoryview)) or kind.__module__ == "array":
        found = "buffer"
    else:
        found = "object"
    _KINDS[kind] = found
    return found


def root_array(array: Any) -> Any:
    """The array that owns the memory a view of NumPy's shows."""
    numpy = sys.modules["numpy"]
    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _slot_values(value: Any) -> tuple[Any, ...] | None:
    names = [slot for kind in type(value).__mro__
             for slot in getattr(kind, "__slots__", ()) if slot not in ("__dict__",
                                                                          "__weakref__")]
    if not names:
        return None
    return tuple(getattr(value, slot, None) for slot in names)


def _numpy_digest(array: Any) -> bytes:
    import numpy as np  # imported by the user already: is_numpy_array said so

    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        return digest_buffer(np.frombuffer(array.tobytes(), dtype=np.uint8))
    return digest_buffer(array.reshape(-1, order="A").view(np.uint8))


def fingerprints(namespace: dict[str, Any], names: list[str], deep: Callable[[str], bool],
                 walk: Walk) -> dict[str, int]:
    """Every name's fingerprint; the names the cell could reach go first, so the digests
    they refresh are the ones the other names see."""
    ordered = sorted(names, key=lambda name: not deep(name))
    return {name: walk.name(name, namespace[name], deep(name)) for name in ordered}
