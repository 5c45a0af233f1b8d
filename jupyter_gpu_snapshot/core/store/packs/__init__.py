"""Image files kept by content: each 4 KiB page stored once per store, pages of zeros never.

A large image file becomes a recipe (the ids of its pages, ``recipes.py``) beside the
snapshot's manifest; the pages the store lacks are appended to a new pack under the store's
``chunks/`` (``layout.py``). The rooms:

- ``layout.py``: the packs, their ids and the index over them (the on-disk format);
- ``recipes.py``: the recipe of a file (its format, and writing it);
- ``plans.py``: where a recipe's pages are, remembered for the next restore (``.where``);
- ``page_store.py``: ``PageStore``, the directory as saves, restores and transfers use it;
- ``collector.py``: what no recipe needs, freed;
- ``id_workers.py``: page ids, by worker processes for large files;
- ``follower.py``: the ids and digests of a save's images, read while criu writes them;
- ``fd_io.py``: bytes moved between descriptors, in the kernel where it can be.

The rest of the store uses these names; tests that change a tunable of the id workers
(``STEP``, ``PARALLEL_IDS_BYTES``, ``MIN_CORES_FOR_WORKERS``) set it on ``id_workers``.
"""

from .collector import REPACK_BELOW, CollectReport
from .fd_io import copy_range, pread_exactly, splice_exactly, write_all
from .follower import DumpFollower, FollowedFile
from .id_workers import ids_of_range, page_ids
from .layout import (
    CHUNKS_DIR,
    ID_BYTES,
    ID_CONTEXT,
    IDS_SUFFIX,
    LOCK_KEY,
    PACK_SUFFIX,
    PAGE,
    ZERO_ID,
    Ids,
    PackIndex,
    PackWriter,
    argsort,
)
from .page_store import PageStore
from .plans import PLAN_SUFFIX, PagePlan, RememberedPlan
from .recipes import (
    MIN_CHUNKED_BYTES,
    RECIPE_SUFFIX,
    FileRecipe,
    ids_in_order,
    is_chunkable,
    recipe_name,
    recipe_voids,
)

__all__ = [
    "CHUNKS_DIR",
    "IDS_SUFFIX",
    "ID_BYTES",
    "ID_CONTEXT",
    "LOCK_KEY",
    "MIN_CHUNKED_BYTES",
    "PACK_SUFFIX",
    "PAGE",
    "PLAN_SUFFIX",
    "RECIPE_SUFFIX",
    "REPACK_BELOW",
    "ZERO_ID",
    "CollectReport",
    "DumpFollower",
    "FileRecipe",
    "FollowedFile",
    "Ids",
    "PackIndex",
    "PackWriter",
    "PagePlan",
    "PageStore",
    "RememberedPlan",
    "argsort",
    "copy_range",
    "ids_in_order",
    "ids_of_range",
    "is_chunkable",
    "page_ids",
    "pread_exactly",
    "recipe_name",
    "recipe_voids",
    "splice_exactly",
    "write_all",
]
