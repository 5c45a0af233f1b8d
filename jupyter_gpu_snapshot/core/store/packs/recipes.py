"""Recipes: a large image file kept as the ids of its pages, beside the snapshot's manifest.

The signed manifest lists the recipe's digest and the digest of the whole file, so nothing
read from ``chunks/`` is trusted: a restore assembles the whole files and checks them
against the manifest beside criu, as it checks files kept whole.

FORMAT (this module names and writes it; ``images.read_recipe`` checks it before use)

In a snapshot directory, ``<file>.chunks`` (``RECIPE_SUFFIX``, a name kept from before the
packs had their own words) is the recipe of ``<file>``: the id of each of its pages
(``layout.py``), ``ID_BYTES`` (16) bytes each, in the file's order, no header. A page of
zeros has the zero id. So a recipe is ``size / 4096 * 16`` bytes long, and the file is
kept as one only when it is at least ``MIN_CHUNKED_BYTES`` (1 MiB), a whole number of
pages, and its snapshot's digest is BLAKE3.

The manifest's ``files`` entry of ``<file>`` then carries ``"chunks"``: the BLAKE3
(unkeyed, hex) of the recipe's bytes, beside the file's ``size`` and ``digest``
(``images.digest_new``). A recipe is used only once its length and that BLAKE3 match the
signed entry (``images.recipe_matches``). It is written as ``.<file>.chunks.new`` (0600,
fsynced), renamed into place, and the directory fsynced (``write_recipe``); a commit's
recipes are in the snapshot directory before it lets go of the chunks lock, so the
collector sees every page they keep alive.
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
