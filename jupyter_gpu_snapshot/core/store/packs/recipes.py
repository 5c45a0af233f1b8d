"""Recipes: a large image file kept as the ids of its pages, beside the snapshot's manifest.

In a snapshot directory, ``<file>.chunks`` is the recipe of ``<file>``: one id per page, the
zero id for a page of zeros. The signed manifest lists the recipe's digest and the digest of
the whole file, so nothing read from ``chunks/`` is trusted: a restore assembles the whole
files and checks them against the manifest beside criu, as it checks files kept whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ... import safe_fs
from .layout import ID_BYTES, PAGE, VOID, ZERO_ID, Ids, voids

RECIPE_SUFFIX = ".chunks"
# Files smaller than this stay whole: CRIU's small images change at every save anyway.
MIN_CHUNKED_BYTES = 1 << 20


def is_chunkable(size: int) -> bool:
    return size >= MIN_CHUNKED_BYTES and size % PAGE == 0


def recipe_name(name: str) -> str:
    return f"{name}{RECIPE_SUFFIX}"



@dataclass
class FileRecipe:
    """What chunking one image file gave: its digest, recipe, and the bytes written."""

    digest: str
    recipe: bytes
    new_bytes: int
    zero_pages: int



def write_recipe(image_dfd: int, name: str, recipe: bytes) -> None:
    """``<name>.chunks`` beside the image file ``name``, staged and renamed into place (the
    caller fsyncs the directory)."""
    staged = f".{recipe_name(name)}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staged, dir_fd=image_dfd)
    safe_fs.write_new(staged, image_dfd, recipe)
    os.rename(staged, recipe_name(name), src_dir_fd=image_dfd, dst_dir_fd=image_dfd)


def recipe_voids(recipe: bytes) -> npt.NDArray[np.void]:
    """The distinct ids of the pages a recipe needs, sorted, without the zero id."""
    unique = np.unique(voids(np.frombuffer(recipe, np.uint8).reshape(-1, ID_BYTES)))
    needed: npt.NDArray[np.void] = unique[unique != np.frombuffer(ZERO_ID, VOID)[0]]
    return needed


def ids_in_order(recipes: Iterable[bytes]) -> Ids:
    """The distinct ids ``recipes`` need, without the zero id, in the order they first
    appear: pages that follow each other in a file stay together in a pack made from
    them, so assembling the file later copies long runs."""
    every = np.concatenate([np.frombuffer(r, np.uint8) for r in recipes] or
                           [np.zeros(0, np.uint8)]).reshape(-1, ID_BYTES)
    _, first = np.unique(voids(every), return_index=True)
    first.sort()
    ordered: Ids = every[first]
    return ordered[ordered.any(axis=1)]
