"""The tensor file of a portable copy, ``portable.tensors.safetensors``: its layout, and the
writer that streams every tensor into it.

It holds every NumPy array, PyTorch tensor, JAX array and CuPy array reachable from the
user's names, each once (a tensor shared by two names, or by a model and its optimizer, is
one entry), in the standard safetensors format. Its metadata
(``__metadata__["jupyter_gpu_snapshot.portable"]``, a JSON string) records for each tensor
its framework, original dtype and device, and for PyTorch whether it was a ``Parameter``
and required grad. Other dtypes (complex128, datetime64, the float8 kinds: NumPy reads
those only through ml_dtypes, which safetensors' NumPy reader does not use) are stored as
their raw bytes (``U8``), with the real dtype and shape in that metadata. ``write``
describes the tensors and calls ``write_tensor_file``; ``load`` reads the file back with
``safetensors.safe_open``.

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
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .report import NotPortable, PortableCopyAbandoned, reason

if TYPE_CHECKING:
    import numpy as np

TENSOR_FILE = "portable.tensors.safetensors"
METADATA_KEY = "jupyter_gpu_snapshot.portable"

# The snapshot store's page: tensors of the file start on one, and the file ends on one.
PAGE_BYTES = 4096
# Tensors from this size on are aligned to pages; smaller ones are packed together.
ALIGNED_MIN_BYTES = 64 << 10
# The name of each entry of zero bytes that fills a gap before an aligned tensor.
PADDING_PREFIX = "__pad__."
# Two pinned buffers of this size: one fills from the GPU while the other goes to disk.
STAGING_CHUNK_BYTES = 64 << 20
_WRITE_SLICE_BYTES = 256 << 20

# The safetensors dtype codes, by the dtype's name in NumPy (ml_dtypes included) and in
# PyTorch (without its "torch." prefix). Other plain dtypes are stored as raw bytes.
SAFETENSORS_CODES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "complex64": "C64",
}


def is_padding(key: str) -> bool:
    """Whether ``key`` of the tensor file is padding, no tensor of the copy."""
    return key.startswith(PADDING_PREFIX)


@dataclass
class TensorEntry:
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


def jax_device_name(device: Any) -> str:
    """A JAX device as the metadata names devices: ``cuda:0`` for a GPU, as PyTorch does."""
    platform = str(getattr(device, "platform", "cpu"))
    return f"{'cuda' if platform == 'gpu' else platform}:{getattr(device, 'id', 0)}"


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


def _file_order(tensor: TensorEntry) -> tuple[int, str, bool]:
    """Host data first, then other frameworks' devices, then CUDA tensors by device; in
    each, the small tensors packed together before those aligned to pages (a page's padding
    then comes only where an aligned tensor does not end on a page)."""
    aligned = tensor.nbytes >= ALIGNED_MIN_BYTES
    if tensor.framework == "torch" and tensor.device.startswith("cuda"):
        return (2, tensor.device, aligned)
    if tensor.framework in ("numpy", "torch"):
        return (0, "", aligned)
    return (1, tensor.device, aligned)


def _layout(tensors: list[TensorEntry]) -> tuple[dict[str, Any], int]:
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


def write_tensor_file(path: Path, tensors: list[TensorEntry],
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


def _cuda_source(tensor: TensorEntry, failed: dict[str, str]) -> Any:
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


def _host_bytes(tensor: TensorEntry) -> np.ndarray:
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


def _write_host(out: IO[bytes], tensor: TensorEntry, failed: dict[str, str]) -> None:
    try:
        data = _host_bytes(tensor)
        if int(data.nbytes) != tensor.nbytes:
            raise NotPortable("it changed size while the copy was written")
    except Exception as exc:
        failed[tensor.key] = reason(exc)
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
