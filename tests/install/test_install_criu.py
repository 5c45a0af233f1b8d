"""scripts/install-criu.sh never leaves a machine without a working criu: handed a criu
source our patches were not made for, it installs the patched criu only once the
self-check (scripts/criu-fill-check.sh) saw memory filled on several CPUs, and stock criu
otherwise; `jupyter gpu-snapshot check` then names the slower criu.

Each scenario is an install into a prefix of its own from a tarball of the patches' base
altered here (its version, a line a patch needs), as a newer Debian upload would be.
Sources and build trees stay in the install's cache (CRIU_CACHE_DIR): the tarballs are
made byte for byte the same each time, so a second run reuses the same builds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.criu_build import SLOWER_WITHOUT_FAST_FILL

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install-criu.sh"
SERIES = ROOT / "scripts" / "criu-patches"
OTHER_VERSION = "4.2.99"

# A criu build takes minutes on two busy cores.
pytestmark = pytest.mark.timeout(3600)


def install(prefix: Path, **env: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True,
                         env={**os.environ, "CRIU_PREFIX": str(prefix), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def note(prefix: Path) -> dict[str, str]:
    lines = (prefix / "lib/jupyter-gpu-snapshot/criu/built-for").read_text().splitlines()
    return {"first": lines[0], **dict(line.split(": ", 1) for line in lines[1:])}


def check(prefix: Path, store: Path) -> dict[str, dict[str, object]]:
    """`jupyter gpu-snapshot check` with the criu and the plugin of ``prefix``."""
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), "check",
         "--json"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "JUPYTER_GPU_SNAPSHOT_CRIU": str(prefix / "sbin/criu"),
             "JUPYTER_GPU_SNAPSHOT_LIBDIR": str(prefix / "lib/jupyter-gpu-snapshot")})
    return {c["name"]: c for c in json.loads(out.stdout)}


@pytest.fixture(scope="module")
def base_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The patches' base source (fetched and checked by the install), unpacked."""
    out = subprocess.run(["bash", str(INSTALL), "source"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tree = tmp_path_factory.mktemp("base")
    with tarfile.open(out.stdout.strip()) as tar:
        tar.extractall(tree, filter="tar")
    [top] = tree.iterdir()
    return top


def packed(tree: Path, into: Path) -> Path:
    """``tree`` as a criu source tarball, the same bytes for the same tree."""
    tarball = into / f"criu_{OTHER_VERSION}.orig.tar.xz"
    subprocess.run(["tar", "-C", str(tree.parent), "--sort=name", "--mtime=@0", "--owner=0",
                    "--group=0", "--numeric-owner", "-cJf", str(tarball),
                    f"--transform=s,^{tree.name},criu-{OTHER_VERSION},", tree.name],
                   check=True, env={**os.environ, "XZ_OPT": "-T1"})
    return tarball


def with_other_version(base: Path, into: Path) -> Path:
    """A copy of the base whose version is OTHER_VERSION."""
    tree = into / f"criu-{OTHER_VERSION}"
    subprocess.run(["cp", "-a", str(base), str(tree)], check=True)
    versions = tree / "Makefile.versions"
    text = re.sub(r"(CRIU_VERSION_SUBLEVEL\s*:=\s*)\d+", rf"\g<1>{OTHER_VERSION.split('.')[2]}",
                  versions.read_text())
    versions.write_text(text)
    return tree


def break_first_hunk(tree: Path) -> str:
    """Changes a line the series' first hunk needs (applied without fuzz, the hunk fails);
    a trailing comment on a C statement, which any criu still builds. The file changed."""
    target = ""
    for line in sorted(SERIES.glob("*.patch"))[0].read_text().splitlines():
        if line.startswith("+++ b/"):
            target = line.removeprefix("+++ b/")
        elif line.startswith(("-", " ")) and not line.startswith("---") and \
                line.rstrip().endswith(";") and target.endswith(".c"):
            path = tree / target
            text = path.read_text()
            assert line[1:] + "\n" in text
            path.write_text(text.replace(line[1:] + "\n", line[1:] + " /* changed */\n"))
            return target
    raise AssertionError("no statement in the series' first patch to change")


def stock_verdict(checks: dict[str, dict[str, object]], why: str) -> None:
    """The check names the slower criu and why, and asks for nothing: it works."""
    fill = checks["criu fill"]
    assert fill["ok"] is False and fill["required"] is False, fill
    detail = str(fill["detail"])
    assert f"stock criu {OTHER_VERSION}" in detail, detail
    assert f"{SLOWER_WITHOUT_FAST_FILL}x as long" in detail, detail
    assert why in detail, detail
    assert checks["criu"]["ok"] is True and checks["criu check"]["ok"] is True, checks
    assert checks["cuda plugin"]["ok"] is True, checks["cuda plugin"]


def test_another_version_gets_the_patches_once_the_self_check_passes(
    base_tree: Path, tmp_path: Path
):
    tarball = packed(with_other_version(base_tree, tmp_path), tmp_path)
    prefix = tmp_path / "prefix"
    out = install(prefix, CRIU_SOURCE_TARBALL=str(tarball))
    assert "restored whole on 2 workers" in out.stderr, out.stderr[-2000:]
    built = note(prefix)
    assert built["first"].startswith(f"Version: {OTHER_VERSION} patches "), built
    assert built["fill"] == "parallel" and built["base"].startswith("no, "), built
    fill = check(prefix, tmp_path / "store")["criu fill"]
    assert fill["ok"] is True and f"criu {OTHER_VERSION} with our patches" in str(
        fill["detail"]), fill
    # A second run keeps what is installed: the same source, the same patches.
    again = install(prefix, CRIU_SOURCE_TARBALL=str(tarball))
    assert "using " in again.stderr and "building" not in again.stderr, again.stderr


def test_a_source_the_patches_do_not_fit_gets_stock_criu(base_tree: Path, tmp_path: Path):
    tree = with_other_version(base_tree, tmp_path)
    changed = break_first_hunk(tree)
    prefix = tmp_path / "prefix"
    out = install(prefix, CRIU_SOURCE_TARBALL=str(packed(tree, tmp_path)))
    assert "installing stock criu" in out.stderr, out.stderr[-2000:]
    built = note(prefix)
    assert built["first"] == f"Version: {OTHER_VERSION} stock", built
    assert built["fill"] == "one thread" and "does not apply" in built["why"], built
    stock_verdict(check(prefix, tmp_path / "store"), "does not apply")
    assert changed in built["why"] or "FAILED" in built["why"], built


def test_a_patched_criu_that_fails_its_self_check_is_not_installed(
    base_tree: Path, tmp_path: Path
):
    """A series that applies and builds but brings no parallel fill (as a port that
    compiles and does not work would): the self-check sees one thread, stock is
    installed."""
    tree = with_other_version(base_tree, tmp_path)
    break_first_hunk(tree)  # the source of the test above: its stock build is reused
    series = tmp_path / "series"
    series.mkdir()
    (series / "0001-a-note.patch").write_text(
        "--- /dev/null\n+++ b/NOTE\n@@ -0,0 +1 @@\n+A file of one line.\n")
    prefix = tmp_path / "prefix"
    out = install(prefix, CRIU_SOURCE_TARBALL=str(packed(tree, tmp_path)),
                  CRIU_PATCHES_DIR=str(series))
    built = note(prefix)
    assert built["first"] == f"Version: {OTHER_VERSION} stock", built
    assert built["why"] == ("the self-check failed: criu restored the memory on one thread: "
                            "it has no parallel fill"), built
    stock_verdict(check(prefix, tmp_path / "store"), "the self-check failed")
    assert "installing stock criu" in out.stderr
