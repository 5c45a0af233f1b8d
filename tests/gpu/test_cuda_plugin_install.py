"""Where CRIU's CUDA plugin and the cuda-checkpoint stand-in must be for a GPU save, and the
refusals when they are not: missing, built for another criu, or changeable by other users
(criu runs with our privileges and loads every library of the plugin directory)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from jupyter_gpu_snapshot._constants import DEFAULT_LIBDIR
from jupyter_gpu_snapshot.core.criu_build import read_note
from jupyter_gpu_snapshot.gpu.broker import PluginInstall


@pytest.fixture
def install(tmp_path: Path) -> PluginInstall:
    """A copy of what scripts/install-criu.sh installed (make test runs it)."""
    root = tmp_path / "lib"
    shutil.copytree(DEFAULT_LIBDIR, root, symlinks=True)
    return PluginInstall(root)


def criu_version_built_for(install: PluginInstall) -> str:
    """'4.2.1' of the install's note, 'Version: 4.2.1 patches 0123abcd' (or '... stock')."""
    build = read_note(install.plugin_dir)
    assert build is not None, "scripts/install-criu.sh left no note of its criu"
    return build.version


def test_the_installed_plugin_fits_this_criu(install: PluginInstall):
    built_for = criu_version_built_for(install)
    assert install.problem(built_for) is None
    assert f"built for criu {built_for}, not for this criu 9.9.9" in (
        install.problem("9.9.9") or "")


@pytest.mark.parametrize("part", ["criu", "criu/cuda_plugin.so", "bin", "bin/cuda-checkpoint"])
def test_a_plugin_others_can_change_is_refused(install: PluginInstall, part: str):
    built_for = criu_version_built_for(install)
    path = install.root / part
    os.chmod(path, path.stat().st_mode | 0o002)
    assert install.problem(built_for) == (
        f"{path} is writable by other users: criu, run with our privileges, would load it")


def test_a_missing_plugin_or_stand_in_is_named(install: PluginInstall):
    (install.shim_dir / "cuda-checkpoint").unlink()
    assert "stand-in is not installed" in (install.problem("4.2.1") or "")
    (install.plugin_dir / "cuda_plugin.so").unlink()
    assert "is not installed" in (install.problem("4.2.1") or "")
