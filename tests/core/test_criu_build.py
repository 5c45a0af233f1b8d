"""The install's note of its criu (scripts/install-criu.sh's built-for), as the check and
the kernels' status read it: ours with the fast fill, stock and why, or not the criu the
note describes."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from jupyter_gpu_snapshot.core.criu_build import (
    SLOWER_WITHOUT_FAST_FILL,
    describe_fill,
    parse_note,
)

PATCHED = """Version: 4.2.1 patches f2bb4ace75b1a30f
fill: parallel
source: criu_4.2.1.orig.tar.xz sha256 29ec0ee0
base: yes
wanted: patches f2bb4ace75b1a30f
criu-sha256: {sha}
"""
PATCH = "0001-mem-fill-private-memory-on-several-threads-at-restor.patch"
STOCK = f"""Version: 4.3 stock
fill: one thread
why: {PATCH} does not apply: 1 out of 4 hunks FAILED
source: criu_4.3.orig.tar.xz sha256 0123
base: no, the patches' base is 4.2.1
wanted: patches f2bb4ace75b1a30f
criu-sha256: {{sha}}
"""


def _criu(tmp_path: Path) -> tuple[Path, str]:
    """A stand-in criu binary and its digest (only its bytes are read)."""
    criu = tmp_path / "criu"
    shutil.copy("/bin/true", criu)
    return criu, hashlib.sha256(criu.read_bytes()).hexdigest()


def test_the_notes_of_older_installs_were_always_patched():
    build = parse_note("Version: 4.2.1 patches f2bb4ace75b1a30f\n")
    assert build is not None and build.version == "4.2.1" and build.fast_fill
    assert build.criu_sha256 is None
    assert parse_note("") is None and parse_note("garbage\n") is None


def test_a_patched_criu_says_so(tmp_path: Path):
    criu, sha = _criu(tmp_path)
    (tmp_path / "built-for").write_text(PATCHED.format(sha=sha))
    fill = describe_fill(criu, tmp_path)
    assert (fill.version, fill.fast) == ("4.2.1", True)
    assert fill.to_dict() == {"version": "4.2.1", "fast_fill": True, "detail": fill.detail}


def test_a_stock_criu_names_what_it_costs_and_why(tmp_path: Path):
    criu, sha = _criu(tmp_path)
    (tmp_path / "built-for").write_text(STOCK.format(sha=sha))
    fill = describe_fill(criu, tmp_path)
    assert (fill.version, fill.fast) == ("4.3", False)
    assert fill.detail == (
        "stock criu 4.3: restored memory is filled on one thread, so restores of large "
        f"kernels take about {SLOWER_WITHOUT_FAST_FILL}x as long; "
        "0001-mem-fill-private-memory-on-several-threads-at-restor.patch does not apply: 1 out "
        "of 4 hunks FAILED")


def test_a_criu_the_note_does_not_describe_is_not_taken_for_it(tmp_path: Path):
    criu, _ = _criu(tmp_path)
    (tmp_path / "built-for").write_text(PATCHED.format(sha="0" * 64))
    fill = describe_fill(criu, tmp_path)
    assert fill.fast is None and "is not the criu that scripts/install-criu.sh built" in \
        fill.detail
    (tmp_path / "built-for").unlink()
    fill = describe_fill(criu, tmp_path)
    assert fill.fast is None and "was not installed by scripts/install-criu.sh" in fill.detail
