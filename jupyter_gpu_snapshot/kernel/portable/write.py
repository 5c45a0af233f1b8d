"""Writing a portable copy of a kernel's namespace: ``write_portable``.

Into one existing directory, every file named ``portable.*``:

- ``portable.tensors.safetensors``: every tensor reachable from the user's names, each once
  (``tensor_file``, which lays it out and streams it).
- ``portable.NNNN.<name>.dill``: one dill pickle per carried name, in which every tensor is
  a persistent id naming its entry in the tensor file. Objects keep their structure (a
  module keeps its submodules, a dict of tensors stays a dict), and an object that is the
  value of another, earlier name is a reference to that name, so ``trainer.model is
  model`` holds again after loading. Modules (``import numpy as np``) are carried by
  reference: their name is re-imported.
- ``portable.report.json``: the report, written last: its presence means the copy is
  complete.

Honest limits
-------------
- Not carried, with the reason in the report: open files, sockets, threads, processes and
  subprocesses, generators and coroutines, the IPython shell itself, and anything dill
  cannot pickle (the exception's text is the reason). A name that holds one of these
  (a dict with an open file in it) is not carried either; the other names are.
- Gradients (``.grad``), autograd history and storage sharing between *different* views
  of one tensor are not kept: each view is written as its own data.
- Objects shared between two names stay shared only where the shared object is the value
  of a name that comes earlier in the copy (modules, classes and functions first, then the
  namespace's order); otherwise each name gets its own copy of it.
- Functions and classes defined in the notebook are pickled by value; their globals are
  the loading kernel's namespace (``__main__``), so they see the names loaded beside them.
- The copy is of one moment only if no other thread changes the objects meanwhile; the
  kernel side (``portable_request``) makes sure no cell runs while it is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .report import (
    FILE_NAME,
    REPORT_FILE,
    REPORT_FORMAT,
    NotPortable,
    PortableCopyAbandoned,
    reason,
)
from .tensor_file import (
    SAFETENSORS_CODES,
    TENSOR_FILE,
    TensorEntry,
    jax_device_name,
    write_tensor_file,
)

IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})
PICKLE_PROTOCOL = 5

# NumPy dtype kinds whose bytes mean the same everywhere once little-endian.
_RAW_NUMPY_KINDS = frozenset("biufcmM")
_ATOMIC_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
# Immutable values whose identity means nothing: never a reference to another name (an
# empty tuple named by the user would otherwise stand for every empty tuple pickled).
_UNSHARED_TYPES = _ATOMIC_TYPES | {tuple, frozenset, type(Ellipsis), type(NotImplemented)}


def is_user_name(name: object) -> bool:
    """Whether ``name`` in a kernel's namespace is the user's, not IPython's own."""
    return isinstance(name, str) and not name.startswith("_") and name not in IPYTHON_NAMES



@dataclass
class _NameCopy:
    """What pickling one name produced."""

    file: str
    pickle_bytes: int
    keys: list[str]
    new_keys: list[str]


class _TensorTable:
    """Every tensor the pickles refer to, each once, keyed by the object's identity.

    Holding the objects keeps their ids from being reused by others while the copy is
    written.
    """

    def __init__(self) -> None:
        self.by_id: dict[int, TensorEntry] = {}
        self.count = 0

    def key_for(self, obj: Any, describe: Callable[[Any, str], TensorEntry | None],
                pending: dict[int, TensorEntry]) -> str | None:
        known = self.by_id.get(id(obj)) or pending.get(id(obj))
        if known is not None:
            return known.key
        described = describe(obj, f"t{self.count + len(pending)}")
        if described is None:
            return None
        pending[id(obj)] = described
        return described.key

    def commit(self, pending: dict[int, TensorEntry]) -> None:
        self.by_id.update(pending)
        self.count += len(pending)


def _qualified_type(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _kind(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return "module"
    if isinstance(value, type):
        return "class"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return "function"
    return _qualified_type(value)


def _copy_order(value: Any) -> int:
    """Modules, classes and functions first: other names refer to them."""
    if isinstance(value, types.ModuleType):
        return 0
    if isinstance(value, type):
        return 1
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return 2
    return 3


def refusal(kind: type) -> str | None:
    """Why objects of this type are never carried, or None."""
    if issubclass(kind, (types.GeneratorType, types.AsyncGeneratorType)):
        return "a generator"
    if issubclass(kind, types.CoroutineType):
        return "a coroutine"
    if issubclass(kind, io.IOBase) and not issubclass(kind, (io.BytesIO, io.StringIO)):
        return "an open file"
    if issubclass(kind, socket.socket):
        return "a socket"
    if issubclass(kind, threading.Thread):
        return "a thread"
    if issubclass(kind, subprocess.Popen):
        return "a subprocess"
    if issubclass(kind, types.FrameType):
        return "a running frame"
    module = kind.__module__ or ""
    if module.startswith("multiprocessing") and kind.__name__.endswith("Process"):
        return "a process"
    if module.startswith("zmq"):
        return "a ZMQ socket or context"
    if module.startswith(("IPython.core.interactiveshell", "ipykernel")):
        return "the IPython shell or kernel"
    if module == "mmap":
        return "a memory map"
    if module == "sqlite3" and kind.__name__ in ("Connection", "Cursor"):
        return "a database connection"
    return None


def _numpy_description(array: Any, key: str, framework: str, device: str,
                       nbytes: int | None = None) -> TensorEntry | None:
    """An array of a NumPy dtype, or None where NumPy's own pickle must carry it."""
    import numpy as np

    dtype = np.dtype(array.dtype)
    if dtype.hasobject or dtype.names is not None or dtype.subdtype is not None:
        return None
    builtin = dtype.kind in _RAW_NUMPY_KINDS
    if not builtin and not type(dtype).__module__.startswith("ml_dtypes") and \
            not dtype.type.__module__.startswith("ml_dtypes"):
        return None
    shape = [int(n) for n in array.shape]
    size = int(nbytes if nbytes is not None else array.nbytes)
    info: dict[str, Any] = {"framework": framework, "dtype": dtype.name, "device": device,
                            "numpy_dtype": dtype.str if builtin else None}
    code = SAFETENSORS_CODES.get(dtype.name)
    if code is None:
        code = "U8"
        info["raw"] = True
        info["shape"] = shape
        shape = [size]
    return TensorEntry(key, array, framework, code, shape, size, device, info)


class _Pickling:
    """The pickler's hooks: tensors to keys, earlier names to references, refusals."""

    def __init__(self, table: _TensorTable, earlier: Mapping[int, tuple[str, Any]]) -> None:
        self.table = table
        self.earlier = earlier
        self.verdicts: dict[type, str | None] = {}
        self.numpy = sys.modules.get("numpy")
        self.torch = sys.modules.get("torch")
        self.jax = sys.modules.get("jax")
        self.cupy = sys.modules.get("cupy")
        self.root: Any = None
        self.pending: dict[int, TensorEntry] = {}
        self.keys: list[str] = []

    def start(self, root: Any) -> None:
        self.root = root
        self.pending = {}
        self.keys = []

    def _verdict(self, kind: type) -> str | None:
        if kind in self.verdicts:
            return self.verdicts[kind]
        verdict: str | None = None
        if self.numpy is not None and kind is self.numpy.ndarray:
            verdict = "numpy"
        elif self.torch is not None and kind in (self.torch.Tensor, self.torch.nn.Parameter):
            verdict = "torch"
        elif self.jax is not None and issubclass(kind, self.jax.Array):
            verdict = "jax"
        elif self.cupy is not None and issubclass(kind, self.cupy.ndarray):
            verdict = "cupy"
        else:
            refused = refusal(kind)
            verdict = f"refuse:{refused}" if refused else None
        self.verdicts[kind] = verdict
        return verdict

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMIC_TYPES:
            return None
        earlier = self.earlier.get(id(obj))
        if earlier is not None and earlier[1] is obj:
            return ("name", earlier[0])
        verdict = self.verdicts[kind] if kind in self.verdicts else self._verdict(kind)
        if verdict is None:
            return None
        if verdict.startswith("refuse:"):
            reason = verdict[len("refuse:"):]
            raise NotPortable(reason if obj is self.root else f"it holds {reason}")
        key = self.table.key_for(obj, self._describe, self.pending)
        if key is None:
            return None
        self.keys.append(key)
        return ("tensor", key)

    def _describe(self, obj: Any, key: str) -> TensorEntry | None:
        framework = self.verdicts[type(obj)]
        if framework == "numpy":
            return _numpy_description(obj, key, "numpy", "cpu")
        if framework == "torch":
            return self._describe_torch(obj, key)
        if framework == "jax":
            if not getattr(obj, "is_fully_addressable", True):
                return None
            devices = sorted(jax_device_name(d) for d in obj.devices())
            size = int(obj.size) * int(obj.dtype.itemsize)
            return _numpy_description(obj, key, "jax", ",".join(devices), size)
        if framework == "cupy":
            return _numpy_description(obj, key, "cupy", f"cuda:{obj.device.id}")
        return None

    def _describe_torch(self, tensor: Any, key: str) -> TensorEntry | None:
        torch = self.torch
        assert torch is not None
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            return None  # torch's own pickle carries these, if anything does
        if tensor.device.type == "meta":
            raise NotPortable("a tensor on the meta device (it has no data)")
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = [int(n) for n in tensor.shape]
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        info: dict[str, Any] = {
            "framework": "torch", "dtype": dtype, "device": str(tensor.device),
            "parameter": isinstance(tensor, torch.nn.Parameter),
            "requires_grad": bool(tensor.requires_grad),
        }
        code = SAFETENSORS_CODES.get(dtype)
        if code is None:
            code = "U8"
            info["raw"] = True
            info["shape"] = shape
            shape = [nbytes]
        return TensorEntry(key, tensor, "torch", code, shape, nbytes, str(tensor.device), info)


_PICKLER_CLASS: type | None = None


def _pickler_class() -> type:
    """A dill pickler that asks a ``_Pickling`` for persistent ids (dill imports lazily)."""
    global _PICKLER_CLASS
    if _PICKLER_CLASS is None:
        import dill  # type: ignore[import-untyped]

        class Pickler(dill.Pickler):  # type: ignore[misc]
            def __init__(self, file: IO[bytes], hooks: _Pickling) -> None:
                # Explicit settings: a user's dill.settings must not change the format.
                super().__init__(file, protocol=PICKLE_PROTOCOL, byref=False, recurse=False)
                self._hooks = hooks

            def persistent_id(self, obj: Any) -> Any:
                return self._hooks.persistent_id(obj)

        _PICKLER_CLASS = Pickler
    return _PICKLER_CLASS


def _pickle_file_name(index: int, name: str) -> str:
    candidate = f"portable.{index:04d}.{name}.dill"
    if FILE_NAME.match(candidate):
        return candidate
    return f"portable.{index:04d}.dill"


def portable_names(namespace: Mapping[str, Any]) -> list[str]:
    """The user's names of ``namespace`` in the order a copy writes and loads them."""
    names = [name for name in list(namespace) if is_user_name(name)]
    return sorted(names, key=lambda name: _copy_order(namespace.get(name)))


def write_portable(namespace: Mapping[str, Any], directory: Path, *,
                   hidden: Mapping[str, Any] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Write a portable copy of the user's names of ``namespace`` into ``directory``.

    ``directory`` must exist. Returns the report (also written as ``portable.report.json``,
    last)::

        {"files": [names written], "bytes": int, "seconds": float, "format": 1,
         "carried": [{"name", "kind", "bytes", "devices", "file"? , "module"?}],
         "not_carried": [{"name", "reason"}]}

    ``hidden``: what the shell itself put in the namespace (``shell.user_ns_hidden``); a
    name still bound to that value is IPython's (its ``open``), not the user's.

    One name that cannot be carried never spoils the others. ``should_stop`` is asked
    between names and between chunks of data; when it says yes, the files written so far
    are removed and ``PortableCopyAbandoned`` is raised.
    """
    started = time.monotonic()
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"no directory {directory}")
    stop = should_stop or (lambda: False)
    pickler_class = _pickler_class()
    table = _TensorTable()
    earlier: dict[int, tuple[str, Any]] = {}
    hooks = _Pickling(table, earlier)
    carried: list[dict[str, Any]] = []
    not_carried: list[dict[str, str]] = []
    copies: dict[str, _NameCopy] = {}
    written: list[Path] = []
    items = list(namespace.items())
    shells = hidden or {}
    values = {
        name: value for name, value in items
        if isinstance(name, str) and not (name in shells and shells[name] is value)
    }
    try:
        for index, name in enumerate(portable_names(values)):
            if stop():
                raise PortableCopyAbandoned("the copy was abandoned")
            value = values[name]
            if isinstance(value, types.ModuleType):
                carried.append({"name": name, "kind": "module", "bytes": 0, "devices": [],
                                "module": value.__name__})
                continue
            path = directory / _pickle_file_name(index, name)
            try:
                copy = _pickle_one(pickler_class, hooks, value, path)
            except Exception as exc:
                with contextlib.suppress(OSError):
                    path.unlink()
                not_carried.append({"name": name, "reason": reason(exc)})
                continue
            written.append(path)
            copies[name] = copy
            carried.append({"name": name, "kind": _kind(value), "bytes": 0, "devices": [],
                            "file": copy.file})
            if type(value) not in _UNSHARED_TYPES:
                earlier[id(value)] = (name, value)

        entries = list(table.by_id.values())
        failed: dict[str, str] = {}
        if entries:
            path = directory / TENSOR_FILE
            written.append(path)
            failed = write_tensor_file(path, entries, stop)
        carried, dropped = _settle(carried, copies, {t.key: t for t in entries}, failed,
                                   directory)
        not_carried.extend(dropped)
        files = [p.name for p in written if p.exists()]
        total = sum((directory / f).stat().st_size for f in files)
        report: dict[str, Any] = {
            "format": REPORT_FORMAT,
            "files": [*files, REPORT_FILE],
            "carried": carried,
            "not_carried": not_carried,
            "bytes": total,
            "seconds": round(time.monotonic() - started, 3),
        }
        # Renamed into place: a report that exists is a whole one.
        report_path = directory / REPORT_FILE
        unfinished = directory / f"{REPORT_FILE}.partial"
        written += [unfinished, report_path]
        unfinished.write_text(json.dumps(report, indent=1))
        unfinished.replace(report_path)
        return report
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise


def _pickle_one(pickler_class: type, hooks: _Pickling, value: Any, path: Path) -> _NameCopy:
    hooks.start(value)
    with open(path, "wb") as out:
        pickler_class(out, hooks).dump(value)
    hooks.table.commit(hooks.pending)
    keys = list(dict.fromkeys(hooks.keys))
    new_keys = [t.key for t in hooks.pending.values()]
    return _NameCopy(path.name, path.stat().st_size, keys, new_keys)


def _settle(carried: list[dict[str, Any]], copies: dict[str, _NameCopy],
            tensors: dict[str, TensorEntry], failed: dict[str, str],
            directory: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Sizes and devices of the carried names; those whose tensors failed are dropped."""
    kept: list[dict[str, Any]] = []
    dropped: list[dict[str, str]] = []
    for entry in carried:
        copy = copies.get(entry["name"])
        if copy is None:
            kept.append(entry)
            continue
        bad = [key for key in copy.keys if key in failed]
        if bad:
            with contextlib.suppress(OSError):
                (directory / copy.file).unlink()
            dropped.append({"name": entry["name"], "reason": failed[bad[0]]})
            continue
        entry["bytes"] = copy.pickle_bytes + sum(tensors[k].nbytes for k in copy.new_keys)
        entry["devices"] = sorted({tensors[k].device for k in copy.keys})
        kept.append(entry)
    return kept, dropped
