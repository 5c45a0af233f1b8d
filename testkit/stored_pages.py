"""The pages of a store's image files kept by content, for tests that damage or forge them.

A committed snapshot keeps each large image file as a recipe (``<file>.chunks``, one 16-byte
page id per 4 KiB page) whose pages live in the store's ``chunks/<pack>.pack``, the ids in
``<pack>.ids`` (``core/store/packs/layout.py``). These helpers read that layout directly,
as someone who edits the disk would, and never through the store.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from jupyter_gpu_snapshot.core.store.packs import (
    CHUNKS_DIR,
    ID_BYTES,
    IDS_SUFFIX,
    PACK_SUFFIX,
    PAGE,
    RECIPE_SUFFIX,
    ZERO_ID,
)


def largest_chunked(snapshot_dir: Path) -> str:
    """The name of the largest image file of the snapshot that is kept as a recipe."""
    files = json.loads((snapshot_dir / "manifest.json").read_text())["files"]
    chunked = [name for name, entry in files.items() if "chunks" in entry
               and (snapshot_dir / f"{name}{RECIPE_SUFFIX}").is_file()]
    assert chunked, f"no image file of {snapshot_dir.name} is kept as a recipe"
    return max(chunked, key=lambda name: int(files[name]["size"]))


def recipe(snapshot_dir: Path, name: str) -> list[bytes]:
    data = (snapshot_dir / f"{name}{RECIPE_SUFFIX}").read_bytes()
    return [data[i:i + ID_BYTES] for i in range(0, len(data), ID_BYTES)]


def _page_places(store_root: Path) -> dict[bytes, tuple[Path, int]]:
    """Where each page of the store lives: its pack and its offset there."""
    places: dict[bytes, tuple[Path, int]] = {}
    for ids_file in sorted((store_root / CHUNKS_DIR).glob(f"*{IDS_SUFFIX}")):
        pack = ids_file.with_suffix(PACK_SUFFIX)
        ids = ids_file.read_bytes()
        for slot in range(len(ids) // ID_BYTES):
            places.setdefault(ids[slot * ID_BYTES:(slot + 1) * ID_BYTES], (pack, slot * PAGE))
    return places


def _uses(store_root: Path) -> Counter[bytes]:
    """How often each page id appears in all recipes of the store's snapshot directories."""
    uses: Counter[bytes] = Counter()
    for recipe_file in store_root.glob(f"*/*{RECIPE_SUFFIX}"):
        data = recipe_file.read_bytes()
        uses.update(data[i:i + ID_BYTES] for i in range(0, len(data), ID_BYTES))
    return uses


def flip_page_byte(store_root: Path, snapshot_dir: Path, name: str, index: int = -1) -> int:
    """Flip one byte, in its pack, of a page of the image file ``name``: one no other page of
    any recipe of the store uses, so only that file changes. The file keeps its size; only
    its digest can tell. Flipping the same page again undoes it. ``index`` asks for that
    page of the file, which must be such a page; by default the one nearest the middle.
    Returns the page's index in the file."""
    ids = recipe(snapshot_dir, name)
    uses = _uses(store_root)
    if index < 0:
        alone = [i for i, page in enumerate(ids) if page != ZERO_ID and uses[page] == 1]
        assert alone, f"every page of {name} is shared or zero"
        index = min(alone, key=lambda i: abs(i - len(ids) // 2))
    assert ids[index] != ZERO_ID and uses[ids[index]] == 1, f"page {index} of {name} is shared"
    pack, offset = _page_places(store_root)[ids[index]]
    with open(pack, "r+b") as f:
        f.seek(offset + PAGE // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return index


def assembled(store_root: Path, snapshot_dir: Path, name: str) -> bytes:
    """The whole image file ``name``, as its recipe and the store's packs give it now."""
    places = _page_places(store_root)
    parts = []
    for page in recipe(snapshot_dir, name):
        if page == ZERO_ID:
            parts.append(bytes(PAGE))
            continue
        pack, offset = places[page]
        with open(pack, "rb") as f:
            f.seek(offset)
            parts.append(f.read(PAGE))
    return b"".join(parts)
