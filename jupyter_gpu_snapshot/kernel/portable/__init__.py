"""A portable copy of a kernel's namespace: what survives when its process image cannot.

A snapshot restores the whole process, which needs the same driver and GPUs. When that
fails, the user's variables can still come back from this copy, loaded into a fresh kernel
on any machine (and the recorded cells, see ``cell_record``, can be re-run for the rest).

The copy is a directory of ``portable.*`` files. ``write`` writes it (one dill pickle per
name, and the report), ``tensor_file`` lays out and streams the one safetensors file that
holds every tensor, ``load`` brings the names back, and ``report`` names the files and
reads the report. Callers import the names below from this package, never its modules;
the server loads a copy in a fresh kernel through ``load_into_kernel``, by this package's
name.
"""

from __future__ import annotations

from .load import PortableLoad, load_into_kernel, load_portable
from .report import FILE_NAME, REPORT_FILE, PortableCopyAbandoned, read_report
from .tensor_file import ALIGNED_MIN_BYTES, METADATA_KEY, PAGE_BYTES, TENSOR_FILE, is_padding
from .write import is_user_name, portable_names, refusal, write_portable

__all__ = [
    "ALIGNED_MIN_BYTES",
    "FILE_NAME",
    "METADATA_KEY",
    "PAGE_BYTES",
    "REPORT_FILE",
    "TENSOR_FILE",
    "PortableCopyAbandoned",
    "PortableLoad",
    "is_padding",
    "is_user_name",
    "load_into_kernel",
    "load_portable",
    "portable_names",
    "read_report",
    "refusal",
    "write_portable",
]
