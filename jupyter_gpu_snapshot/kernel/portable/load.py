"""Loading a portable copy into a namespace: ``load_portable``, and ``load_into_kernel``, what
the server runs in a fresh kernel (``node/fallback.py``).

Each carried name is unpickled in the order it was written, its tensors read lazily from
the tensor file (``tensor_file``) and shared between names as they were, each put on the
kind of device it came from where this machine has one. One name that fails to load is
reported and the others load.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .report import TensorUnavailable, read_report, reason
from .tensor_file import METADATA_KEY, TENSOR_FILE, jax_device_name


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
                raise TensorUnavailable("the copy has no tensor file")
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
                raise TensorUnavailable(f"it refers to {ref!r}, which was not loaded")
            return self.values[ref]
        if kind != "tensor":
            raise TensorUnavailable(f"unknown reference {kind!r} in the copy")
        if ref not in self.tensors:
            self.tensors[ref] = self._tensor(ref)
        value, device = self.tensors[ref]
        self.placement.devices.add(device)
        return value

    def _tensor(self, key: str) -> tuple[Any, str]:
        self._handle("numpy")
        info = self.infos.get(key)
        if info is None:
            raise TensorUnavailable(f"the tensor file has no entry {key!r}")
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
            raise TensorUnavailable(
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
                raise TensorUnavailable(f"this PyTorch has no dtype {info['dtype']}")
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
        return jax.device_put(array, device), jax_device_name(device)

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
        raise TensorUnavailable(
            f"NumPy has no {name} dtype here (PyTorch or ml_dtypes would have it)") from None


_UNPICKLER_CLASS: type | None = None


def _unpickler_class() -> type:
    global _UNPICKLER_CLASS
    if _UNPICKLER_CLASS is None:
        import dill  # type: ignore[import-untyped]

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
                not_loaded.append({"name": name, "reason": reason(exc)})
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
