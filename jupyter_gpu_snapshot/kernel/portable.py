"""A portable copy of a kernel's namespace: what survives when its process image cannot.

A snapshot restores the whole process, which needs the same driver and GPUs. When that
fails, the user's variables can still come back from this copy, loaded into a fresh kernel
on any machine (and the recorded cells, see ``cell_record``, can be re-run for the rest).

What is written
---------------
Into one existing directory, every file named ``portable.*``:

- ``portable.tensors.safetensors``: every NumPy array, PyTorch tensor, JAX array and CuPy
  array reachable from the user's names, each once (a tensor shared by two names, or by a
  model and its optimizer, is one entry), in the standard safetensors format. Its metadata
  (``__metadata__["jupyter_gpu_snapshot.portable"]``, a JSON string) records for each
  tensor its framework, original dtype and device, and for PyTorch whether it was a
  ``Parameter`` and required grad. Other dtypes (complex128, datetime64, the float8
  kinds: NumPy reads those only through ml_dtypes, which safetensors' NumPy reader does not
  use) are stored as their raw bytes (``U8``), with the real dtype and shape in that
  metadata.
- ``portable.NNNN.<name>.dill``: one dill pickle per carried name, in which every tensor is
  a persistent id naming its entry in the tensor file. Objects keep their structure (a
  module keeps its submodules, a dict of tensors stays a dict), and an object that is the
  value of another, earlier name is a reference to that name, so ``trainer.model is
  model`` holds again after loading. Modules (``import numpy as np``) are carried by
  reference: their name is re-imported.
- ``portable.report.json``: the report, written last: its presence means the copy is
  complete.

Why the tensor file is written here rather than by the safetensors library: its writer
takes host pointers for every tensor at once, so a GPU model would need a second, full
host copy first. Here tensors are streamed one at a time (never a second copy of the
namespace in host memory), and CUDA tensors go through two reusable pinned host buffers
in chunks, one filling from the GPU while the other is written to disk. The file is read
back with ``safetensors.safe_open``, so it is a standard file any safetensors reader takes.

Why the tensor file is laid out in pages: the snapshot store keeps a large file by content,
as 4 KiB pages each stored once, and only a file whose size is a whole number of pages. So
that a second copy of unchanged weights adds nothing to the store, every tensor of at least
``ALIGNED_MIN_BYTES`` starts at a page boundary of the file (the header is padded with
spaces, as the format allows, to end on one) and the file ends on one. The format wants
the data fully covered by tensors, without gaps (safetensors refuses a file with any), so
each gap is an explicit entry of zero bytes, dtype ``U8``, named ``__pad__.N``
(``PADDING_PREFIX``): no tensor of a copy has such a name (theirs are ``tN``), the metadata
describes none of them, no pickle refers to one, so loading never sees them; a reader
listing the file's keys skips them with ``is_padding``. Pages of zeros cost the store
nothing. Smaller tensors are packed together, before the aligned ones of their device,
unpadded: aligning each would cost up to a page apiece (4 GiB for a million biases), and
together they are a small share of a namespace's bytes. The cost is at most a page less one
byte per aligned tensor (a 16th of the smallest one), plus at most two pages for the file.

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
  kernel side (``cell_record``) makes sure no cell runs while it is written.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})
TENSOR_FILE = "portable.tensors.safetensors"
REPORT_FILE = "portable.report.json"
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
METADATA_KEY = "jupyter_gpu_snapshot.portable"
REPORT_FORMAT = 1
PICKLE_PROTOCOL = 5

# The snapshot store's page: tensors of the file start on one, and the file ends on one.
PAGE_BYTES = 4096
# Tensors from this size on are aligned to pages; smaller ones are packed together.
ALIGNED_MIN_BYTES = 64 << 10
# The name of each entry of zero bytes that fills a gap before an aligned tensor.
PADDING_PREFIX = "__pad__."
# Two pinned buffers of this size: one fills from the GPU while the other goes to disk.
STAGING_CHUNK_BYTES = 64 << 20
_WRITE_SLICE_BYTES = 256 << 20
_REASON_CHARS = 300

# The safetensors dtype codes, by the dtype's name in NumPy (ml_dtypes included) and in
# PyTorch (without its "torch." prefix). Other plain dtypes are stored as raw bytes.
_SAFETENSORS_CODES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "complex64": "C64",
}
# NumPy dtype kinds whose bytes mean the same everywhere once little-endian.
_RAW_NUMPY_KINDS = frozenset("biufcmM")
_ATOMIC_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
# Immutable values whose identity means nothing: never a reference to another name (an
# empty tuple named by the user would otherwise stand for every empty tuple pickled).
_UNSHARED_TYPES = _ATOMIC_TYPES | {tuple, frozenset, type(Ellipsis), type(NotImplemented)}


def is_padding(key: str) -> bool:
    """Whether ``key`` of the tensor file is padding, no tensor of the copy."""
    return key.startswith(PADDING_PREFIX)


def is_user_name(name: object) -> bool:
    """Whether ``name`` in a kernel's namespace is the user's, not IPython's own."""
    return isinstance(name, str) and not name.startswith("_") and name not in IPYTHON_NAMES


class PortableCopyAbandoned(Exception):
    """Writing stopped because ``should_stop`` said so (the user interrupted)."""


class _NotPortable(Exception):
    """An object that a copy cannot carry, with the reason a person reads."""


class _TensorUnavailable(Exception):
    """A tensor of the copy that cannot be loaded here (a dtype without its library)."""


# -- writing -------------------------------------------------------------------------------


@dataclass
class _Tensor:
    """One array or tensor of the copy: where its data comes from and how to describe it."""

    key: str
    value: Any
    framework: str  # numpy, torch, jax or cupy
    code: str  # its safetensors dtype code
    shape: list[int]
    nbytes: int
    device: str
    info: dict[str, Any]
    offset: int = 0
    padding: int = 0  # zero bytes written before its data, to start it on a page


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
        self.by_id: dict[int, _Tensor] = {}
        self.count = 0

    def key_for(self, obj: Any, describe: Callable[[Any, str], _Tensor | None],
                pending: dict[int, _Tensor]) -> str | None:
        known = self.by_id.get(id(obj)) or pending.get(id(obj))
        if known is not None:
            return known.key
        described = describe(obj, f"t{self.count + len(pending)}")
        if described is None:
            return None
        pending[id(obj)] = described
        return described.key

    def commit(self, pending: dict[int, _Tensor]) -> None:
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


def _refusal(kind: type) -> str | None:
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
                       nbytes: int | None = None) -> _Tensor | None:
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
    code = _SAFETENSORS_CODES.get(dtype.name)
    if code is None:
        code = "U8"
        info["raw"] = True
        info["shape"] = shape
        shape = [size]
    return _Tensor(key, array, framework, code, shape, size, device, info)


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
        self.pending: dict[int, _Tensor] = {}
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
            refusal = _refusal(kind)
            verdict = f"refuse:{refusal}" if refusal else None
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
            raise _NotPortable(reason if obj is self.root else f"it holds {reason}")
        key = self.table.key_for(obj, self._describe, self.pending)
        if key is None:
            return None
        self.keys.append(key)
        return ("tensor", key)

    def _describe(self, obj: Any, key: str) -> _Tensor | None:
        framework = self.verdicts[type(obj)]
        if framework == "numpy":
            return _numpy_description(obj, key, "numpy", "cpu")
        if framework == "torch":
            return self._describe_torch(obj, key)
        if framework == "jax":
            if not getattr(obj, "is_fully_addressable", True):
                return None
            devices = sorted(_jax_device_name(d) for d in obj.devices())
            size = int(obj.size) * int(obj.dtype.itemsize)
            return _numpy_description(obj, key, "jax", ",".join(devices), size)
        if framework == "cupy":
            return _numpy_description(obj, key, "cupy", f"cuda:{obj.device.id}")
        return None

    def _describe_torch(self, tensor: Any, key: str) -> _Tensor | None:
        torch = self.torch
        assert torch is not None
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            return None  # torch's own pickle carries these, if anything does
        if tensor.device.type == "meta":
            raise _NotPortable("a tensor on the meta device (it has no data)")
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = [int(n) for n in tensor.shape]
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        info: dict[str, Any] = {
            "framework": "torch", "dtype": dtype, "device": str(tensor.device),
            "parameter": isinstance(tensor, torch.nn.Parameter),
            "requires_grad": bool(tensor.requires_grad),
        }
        code = _SAFETENSORS_CODES.get(dtype)
        if code is None:
            code = "U8"
            info["raw"] = True
            info["shape"] = shape
            shape = [nbytes]
        return _Tensor(key, tensor, "torch", code, shape, nbytes, str(tensor.device), info)


def _jax_device_name(device: Any) -> str:
    platform = str(getattr(device, "platform", "cpu"))
    return f"{'cuda' if platform == 'gpu' else platform}:{getattr(device, 'id', 0)}"


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


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (_NotPortable, _TensorUnavailable)):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


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
                not_carried.append({"name": name, "reason": _reason(exc)})
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
            failed = _write_tensor_file(path, entries, stop)
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
            tensors: dict[str, _Tensor], failed: dict[str, str],
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


def _write_all(out: IO[bytes], data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        done = out.write(view[:_WRITE_SLICE_BYTES])
        if done is None:
            raise OSError("the portable copy's file refused a write")
        view = view[done:]


_ZEROS = bytes(1 << 20)


def _write_zeros(out: IO[bytes], count: int) -> None:
    while count > 0:
        step = min(count, len(_ZEROS))
        _write_all(out, _ZEROS[:step])
        count -= step


def _file_order(tensor: _Tensor) -> tuple[int, str, bool]:
    """Host data first, then other frameworks' devices, then CUDA tensors by device; in
    each, the small tensors packed together before those aligned to pages (a page's padding
    then comes only where an aligned tensor does not end on a page)."""
    aligned = tensor.nbytes >= ALIGNED_MIN_BYTES
    if tensor.framework == "torch" and tensor.device.startswith("cuda"):
        return (2, tensor.device, aligned)
    if tensor.framework in ("numpy", "torch"):
        return (0, "", aligned)
    return (1, tensor.device, aligned)


def _layout(tensors: list[_Tensor]) -> tuple[dict[str, Any], int]:
    """The header's entries of ``tensors``, in file order, with the padding that starts
    each aligned one on a page and ends the data on one; sets each tensor's offset and
    padding. Returns the entries and the padding after the last tensor.

    Offsets count from the start of the data, which the header's own padding puts on a
    page of the file, so a page boundary of the data is one of the file."""
    entries: dict[str, Any] = {}
    offset = 0
    pads = 0

    def pad(count: int) -> None:
        nonlocal offset, pads
        entries[f"{PADDING_PREFIX}{pads}"] = {"dtype": "U8", "shape": [count],
                                               "data_offsets": [offset, offset + count]}
        offset += count
        pads += 1

    for tensor in tensors:
        tensor.padding = -offset % PAGE_BYTES if tensor.nbytes >= ALIGNED_MIN_BYTES else 0
        if tensor.padding:
            pad(tensor.padding)
        tensor.offset = offset
        entries[tensor.key] = {"dtype": tensor.code, "shape": tensor.shape,
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    tail = -offset % PAGE_BYTES
    if tail:
        pad(tail)
    return entries, tail


def _write_tensor_file(path: Path, tensors: list[_Tensor],
                       stop: Callable[[], bool]) -> dict[str, str]:
    """The safetensors file of ``tensors``, laid out in pages (see the module's
    docstring); returns the keys whose data could not be read (written as zeros, so the
    file stays valid) with the reason."""
    tensors = sorted(tensors, key=_file_order)
    header, tail = _layout(tensors)
    header["__metadata__"] = {METADATA_KEY: json.dumps({t.key: t.info for t in tensors})}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % PAGE_BYTES)  # the data starts on a page
    failed: dict[str, str] = {}
    with open(path, "wb", buffering=0) as out:
        _write_all(out, struct.pack("<Q", len(encoded)) + encoded)
        stager: _CudaStager | None = None
        try:
            for tensor in tensors:
                if stop():
                    raise PortableCopyAbandoned("the copy was abandoned")
                source = _cuda_source(tensor, failed)
                if source is not None:
                    if stager is None:
                        _write_zeros(out, tensor.padding)  # nothing queued: in order
                        stager = _CudaStager(out, sys.modules["torch"], stop)
                    else:
                        stager.pad(tensor.padding)
                    stager.add(source)
                    continue
                if stager is not None:
                    stager.drain()
                _write_zeros(out, tensor.padding)
                _write_host(out, tensor, failed)
            if stager is not None:
                stager.drain()
            _write_zeros(out, tail)
        finally:
            if stager is not None:
                stager.close()
    return failed


def _cuda_source(tensor: _Tensor, failed: dict[str, str]) -> Any:
    """The CUDA tensor's bytes as a flat uint8 CUDA tensor, or None for the host path."""
    if tensor.framework != "torch" or not tensor.device.startswith("cuda"):
        return None
    try:
        data = _torch_plain(tensor.value)
        if not data.is_contiguous():
            data = data.contiguous()
        flat = data.reshape(-1).view(sys.modules["torch"].uint8)
    except Exception:  # no room on the GPU for a contiguous copy: the host path copies
        return None
    if int(flat.numel()) != tensor.nbytes:
        return None  # the host path reports the change
    return flat


def _torch_plain(tensor: Any) -> Any:
    data = tensor.detach()
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    return data


def _host_bytes(tensor: _Tensor) -> np.ndarray:
    """The tensor's bytes in host memory as a flat uint8 array (a copy only where the
    data lives elsewhere or is not contiguous)."""
    import numpy as np

    value = tensor.value
    if tensor.framework == "torch":
        torch = sys.modules["torch"]
        data = _torch_plain(value)
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().reshape(-1).view(torch.uint8)
        return np.asarray(data.numpy())
    if tensor.framework == "jax":
        array = np.asarray(value)
    elif tensor.framework == "cupy":
        array = value.get()
    else:
        array = value
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def _write_host(out: IO[bytes], tensor: _Tensor, failed: dict[str, str]) -> None:
    try:
        data = _host_bytes(tensor)
        if int(data.nbytes) != tensor.nbytes:
            raise _NotPortable("it changed size while the copy was written")
    except Exception as exc:
        failed[tensor.key] = _reason(exc)
        _write_zeros(out, tensor.nbytes)
        return
    _write_all(out, data.data)


class _CudaStager:
    """Copies CUDA bytes to the file through two pinned host buffers, in chunks.

    Chunks of consecutive tensors share a buffer, so many small tensors cost few
    synchronizations. While one buffer is written to disk, the GPU fills the other.
    """

    def __init__(self, out: IO[bytes], torch: Any, stop: Callable[[], bool]) -> None:
        self.out = out
        self.torch = torch
        self.stop = stop
        chunk = self.chunk = STAGING_CHUNK_BYTES
        try:
            self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
        except RuntimeError:  # no pinned memory to be had: pageable buffers still work
            self.buffers = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.current = 0
        self.filled = 0
        self.pending: tuple[int, int, Any] | None = None
        self.device: Any = None
        self.stream: Any = None

    def add(self, flat: Any) -> None:
        torch = self.torch
        if flat.device != self.device:
            self.drain()
            self.device = flat.device
            self.stream = torch.cuda.Stream(device=flat.device)
            self.stream.wait_stream(torch.cuda.current_stream(flat.device))
        # A temporary (a contiguous copy) must outlive the copies queued from it.
        flat.record_stream(self.stream)
        size = int(flat.numel())
        done = 0
        with torch.cuda.stream(self.stream):
            while done < size:
                take = min(self.chunk - self.filled, size - done)
                target = self.buffers[self.current][self.filled:self.filled + take]
                target.copy_(flat[done:done + take], non_blocking=True)
                self.filled += take
                done += take
                if self.filled == self.chunk:
                    self._rotate()

    def pad(self, count: int) -> None:
        """Queue ``count`` zero bytes after what is queued: the padding before a tensor.

        Written by the host into the part of the current buffer no copy targets yet (the
        copies queued so far fill the part before it), so it needs no synchronization."""
        while count > 0:
            take = min(self.chunk - self.filled, count, len(_ZEROS))
            self.views[self.current][self.filled:self.filled + take] = _ZEROS[:take]
            self.filled += take
            count -= take
            if self.filled == self.chunk:
                self._rotate()

    def _rotate(self) -> None:
        if self.stop():
            raise PortableCopyAbandoned("the copy was abandoned")
        event = self.torch.cuda.Event()
        event.record(self.stream)
        self._write_pending()
        self.pending = (self.current, self.filled, event)
        self.current ^= 1
        self.filled = 0

    def _write_pending(self) -> None:
        if self.pending is None:
            return
        index, length, event = self.pending
        self.pending = None
        event.synchronize()
        _write_all(self.out, self.views[index][:length])

    def drain(self) -> None:
        """Write everything queued so far: the file is then up to date."""
        if self.filled:
            self._rotate()
        self._write_pending()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy may still target the buffers
        self.pending = None
        self.views = []
        self.buffers = []


# -- loading -------------------------------------------------------------------------------


class PortableLoad(dict[str, Any]):
    """What ``load_portable`` did; shown as JSON (``application/json`` and ``text/plain``)
    when a kernel displays it, so a client reading ``user_expressions`` gets it as JSON."""

    def _repr_json_(self) -> dict[str, Any]:
        return dict(self)

    def __repr__(self) -> str:
        return json.dumps(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def _try_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:
        return None


@dataclass
class _Placement:
    """Where the tensors of the name being loaded went, and what the user should know."""

    devices: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


class _Loader:
    """Reads the tensor file lazily and unpickles names, sharing tensors between names."""

    def __init__(self, directory: Path, report: Mapping[str, Any], device: str) -> None:
        self.directory = directory
        self.device = device
        self.values: dict[str, Any] = {}
        self.tensors: dict[str, Any] = {}
        self.infos: dict[str, dict[str, Any]] = {}
        self.handles: dict[str, Any] = {}
        self.tensor_path: Path | None = None
        if TENSOR_FILE in report.get("files", []):
            self.tensor_path = directory / TENSOR_FILE
        self.placement = _Placement()
        self.cuda_count: int | None = None
        self.torch: Any = None
        self.torch_checked = False

    def close(self) -> None:
        for handle in self.handles.values():
            with contextlib.suppress(Exception):
                handle.__exit__(None, None, None)
        self.handles.clear()

    def _handle(self, framework: str) -> Any:
        if framework not in self.handles:
            from safetensors import safe_open

            if self.tensor_path is None:
                raise _TensorUnavailable("the copy has no tensor file")
            handle: Any = safe_open(str(self.tensor_path), framework=framework)
            handle.__enter__()
            self.handles[framework] = handle
            if not self.infos:
                metadata = handle.metadata() or {}
                self.infos = json.loads(metadata.get(METADATA_KEY, "{}"))
        return self.handles[framework]

    def _torch(self) -> Any:
        if not self.torch_checked:
            self.torch = _try_import("torch")
            self.torch_checked = True
        return self.torch

    def load(self, entry: Mapping[str, Any]) -> tuple[Any, _Placement]:
        self.placement = _Placement()
        if entry.get("kind") == "module":
            return importlib.import_module(str(entry["module"])), self.placement
        unpickler_class = _unpickler_class()
        with open(self.directory / str(entry["file"]), "rb") as source:
            value = unpickler_class(source, self).load()
        self.values[str(entry["name"])] = value
        return value, self.placement

    def persistent_load(self, pid: Any) -> Any:
        kind, ref = pid
        if kind == "name":
            if ref not in self.values:
                raise _TensorUnavailable(f"it refers to {ref!r}, which was not loaded")
            return self.values[ref]
        if kind != "tensor":
            raise _TensorUnavailable(f"unknown reference {kind!r} in the copy")
        if ref not in self.tensors:
            self.tensors[ref] = self._tensor(ref)
        value, device = self.tensors[ref]
        self.placement.devices.add(device)
        return value

    def _tensor(self, key: str) -> tuple[Any, str]:
        self._handle("numpy")
        info = self.infos.get(key)
        if info is None:
            raise _TensorUnavailable(f"the tensor file has no entry {key!r}")
        framework = info["framework"]
        if framework == "torch":
            return self._torch_tensor(key, info)
        array = self._numpy_array(key, info)
        if framework == "jax":
            return self._jax_array(array, info)
        if framework == "cupy":
            return self._cupy_array(array, info)
        return array, "cpu"

    def _numpy_array(self, key: str, info: Mapping[str, Any]) -> Any:
        import numpy as np

        if info["dtype"] == "bfloat16" and _try_import("ml_dtypes") is None:
            raise _TensorUnavailable(
                "bfloat16 arrays need PyTorch or ml_dtypes, and neither is installed here")
        array = self._handle("numpy").get_tensor(key)
        if info.get("raw"):
            array = array.view(_numpy_dtype(info)).reshape(info["shape"])
        wanted = info.get("numpy_dtype")
        if wanted and np.dtype(wanted).byteorder == ">":
            array = array.astype(np.dtype(wanted))
        if not array.flags.writeable:
            array = array.copy()
        return array

    def _torch_tensor(self, key: str, info: Mapping[str, Any]) -> tuple[Any, str]:
        torch = self._torch()
        if torch is None:
            self.placement.note("PyTorch is not installed here: tensors came back as NumPy "
                                "arrays, on the CPU")
            return self._numpy_array(key, {**info, "numpy_dtype": None}), "cpu"
        tensor = self._handle("pt").get_tensor(key)
        if info.get("raw"):
            dtype = getattr(torch, str(info["dtype"]), None)
            if dtype is None:
                raise _TensorUnavailable(f"this PyTorch has no dtype {info['dtype']}")
            tensor = tensor.view(dtype).reshape(info["shape"])
        target = self._torch_device(str(info["device"]))
        if target != "cpu":
            tensor = tensor.to(target)
        if info.get("parameter"):
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(info.get("requires_grad")))
        elif info.get("requires_grad") and (tensor.is_floating_point() or tensor.is_complex()):
            tensor.requires_grad_(True)
        return tensor, target

    def _torch_device(self, original: str) -> str:
        torch = self.torch
        if original == "cpu" or self.device == "cpu":
            if original != "cpu":
                self.placement.note(f"{original} tensors were loaded on the CPU, as asked")
            return "cpu"
        if self.device != "auto":
            return self.device
        if not original.startswith("cuda"):
            self.placement.note(f"{original} tensors were loaded on the CPU")
            return "cpu"
        if self.cuda_count is None:
            self.cuda_count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
        if self.cuda_count == 0:
            self.placement.note("CUDA is not available here: CUDA tensors were loaded on "
                                "the CPU")
            return "cpu"
        _, _, index_text = original.partition(":")
        index = int(index_text or 0)
        if index >= self.cuda_count:
            self.placement.note(f"this machine has no {original}: tensors from there were "
                                "loaded on cuda:0")
            return "cuda:0"
        return f"cuda:{index}"

    def _jax_array(self, array: Any, info: Mapping[str, Any]) -> tuple[Any, str]:
        jax = _try_import("jax")
        if jax is None:
            self.placement.note("JAX is not installed here: JAX arrays came back as NumPy "
                                "arrays")
            return array, "cpu"
        wants_gpu = str(info["device"]).startswith("cuda") and self.device != "cpu"
        device = None
        if wants_gpu:
            with contextlib.suppress(RuntimeError):
                device = jax.devices("gpu")[0]
            if device is None:
                self.placement.note("JAX has no GPU here: JAX arrays were loaded on the "
                                    "CPU")
        if device is None:
            device = jax.devices("cpu")[0]
        return jax.device_put(array, device), _jax_device_name(device)

    def _cupy_array(self, array: Any, info: Mapping[str, Any]) -> tuple[Any, str]:
        cupy = _try_import("cupy") if self.device != "cpu" else None
        count = 0
        if cupy is not None:
            with contextlib.suppress(Exception):
                count = int(cupy.cuda.runtime.getDeviceCount())
        if cupy is None or count == 0:
            self.placement.note("CuPy or a GPU is missing here: CuPy arrays came back as "
                                "NumPy arrays")
            return array, "cpu"
        _, _, index_text = str(info["device"]).partition(":")
        index = int(index_text or 0)
        index = index if index < count else 0
        with cupy.cuda.Device(index):
            return cupy.asarray(array), f"cuda:{index}"


def _numpy_dtype(info: Mapping[str, Any]) -> Any:
    import numpy as np

    wanted = info.get("numpy_dtype")
    if wanted:
        dtype = np.dtype(wanted)
        return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    name = str(info["dtype"])
    _try_import("ml_dtypes")  # gives NumPy bfloat16 and the float8 kinds, by name
    try:
        return np.dtype(name)
    except TypeError:
        raise _TensorUnavailable(
            f"NumPy has no {name} dtype here (PyTorch or ml_dtypes would have it)") from None


_UNPICKLER_CLASS: type | None = None


def _unpickler_class() -> type:
    global _UNPICKLER_CLASS
    if _UNPICKLER_CLASS is None:
        import dill

        class Unpickler(dill.Unpickler):  # type: ignore[misc]
            def __init__(self, file: IO[bytes], loader: _Loader) -> None:
                # ignore: dill would otherwise swap an instance's class for whatever
                # __main__ holds under that class's name; the copy's references say which.
                super().__init__(file, ignore=True)
                self._loader = loader

            def persistent_load(self, pid: Any) -> Any:
                return self._loader.persistent_load(pid)

        _UNPICKLER_CLASS = Unpickler
    return _UNPICKLER_CLASS


def load_portable(namespace: dict[str, Any], directory: Path, report: Mapping[str, Any],
                  device: str = "auto") -> dict[str, Any]:
    """Load every name a portable copy carried into ``namespace``.

    ``report`` is what ``write_portable`` returned (or its ``portable.report.json``).
    ``device``: ``"auto"`` puts each tensor on the kind of device it came from where this
    machine has one (else on the CPU, with a note), ``"cpu"`` everything on the CPU, and a
    device such as ``"cuda:1"`` every GPU tensor there. Returns::

        {"loaded": [{"name", "kind", "device", "note"?}],
         "not_loaded": [{"name", "reason"}], "notes": [str]}

    Names the copy did not carry are in ``not_loaded`` with the copy's reason. A name that
    fails to load is reported and the others load; nothing here raises for one name.
    """
    directory = Path(directory)
    loaded: list[dict[str, Any]] = []
    not_loaded: list[dict[str, str]] = []
    noted: dict[str, list[str]] = {}
    loader = _Loader(directory, report, device)
    try:
        for entry in report.get("carried", []):
            name = str(entry.get("name"))
            try:
                value, placement = loader.load(entry)
            except Exception as exc:
                not_loaded.append({"name": name, "reason": _reason(exc)})
                continue
            namespace[name] = value
            item: dict[str, Any] = {"name": name, "kind": str(entry.get("kind")),
                                    "device": ",".join(sorted(placement.devices)) or "cpu"}
            if placement.notes:
                item["note"] = "; ".join(placement.notes)
                for text in placement.notes:
                    noted.setdefault(text, []).append(name)
            loaded.append(item)
    finally:
        loader.close()
    notes = [f"{text} ({', '.join(names)})" for text, names in noted.items()]
    for entry in report.get("not_carried", []):
        not_loaded.append({"name": str(entry.get("name")),
                           "reason": f"not carried: {entry.get('reason')}"})
    return {"loaded": loaded, "not_loaded": not_loaded, "notes": notes}


def read_report(directory: Path, report: str | None = None) -> dict[str, Any]:
    """A copy's report: ``report`` as JSON text or a file's path, else the one in
    ``directory``."""
    if report is None:
        text = (Path(directory) / REPORT_FILE).read_text()
    elif report.lstrip().startswith("{"):
        text = report
    else:
        text = Path(report).read_text()
    parsed = json.loads(text)
    if not isinstance(parsed, dict):
        raise ValueError("a portable copy's report is a JSON object")
    return parsed


def load_into_kernel(directory: str, report: str | None = None,
                     device: str = "auto") -> PortableLoad:
    """Load a portable copy into this kernel's namespace; for the server, in a fresh kernel.

    The server sends one execute request, silent and without history, whose code is empty
    and whose ``user_expressions`` evaluate this function, so that nothing lands in the
    user's namespace but the loaded names::

        {"code": "", "silent": true, "store_history": false,
         "user_expressions": {"portable": "__import__('jupyter_gpu_snapshot.kernel.portable',
             fromlist=['load_into_kernel']).load_into_kernel('/path/to/dir')"}}

    (``report``, optional: the report as JSON text or its file's path; by default the
    ``portable.report.json`` in the directory.) The execute reply's
    ``content["user_expressions"]["portable"]`` then holds ``"status": "ok"`` and the
    result of ``load_portable`` in ``data["application/json"]`` (and as JSON text in
    ``data["text/plain"]``); a failure of the whole load (no such directory, an unreadable
    report) is ``"status": "error"`` with ``ename`` and ``evalue``.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("load_into_kernel runs inside an IPython kernel")
    parsed = read_report(Path(directory), report)
    return PortableLoad(load_portable(shell.user_ns, Path(directory), parsed, device))

