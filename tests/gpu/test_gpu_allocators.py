"""Snapshot-ready kernels start with JAX's and TensorFlow's GPU allocators growing, so that a
save copies what the arrays use rather than the pool those frameworks preallocate, and a
value the user set for either variable wins.

Scenarios as data: where a value comes from (the server's environment, the kernelspec's env,
the env the kernel is started with, the setting), and what the running kernel sees.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from traitlets.config import Config

from jupyter_gpu_snapshot._constants import ENV_GROW_GPU_ALLOCATORS, GROWING_ALLOCATOR_ENV
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json
from tests.conftest import KernelHandle, start_kernel, stop_kernel

XLA = "XLA_PYTHON_CLIENT_PREALLOCATE"
TF = "TF_FORCE_GPU_ALLOW_GROWTH"
UNSET = "<unset>"


@dataclass(frozen=True)
class AllocatorCase:
    id: str
    expect: dict[str, str]  # what the kernel's os.environ holds
    server_env: dict[str, str] = field(default_factory=dict)  # the launching process's env
    spec_env: dict[str, str] = field(default_factory=dict)  # the kernelspec's "env"
    start_env: dict[str, str] | None = None  # start_kernel(env=...), the server's way
    setting: bool | None = None  # c.GPUSnapshot.grow_gpu_allocators


CASES = [
    AllocatorCase("default", {XLA: "false", TF: "true"}),
    AllocatorCase("server-environment-wins", {XLA: "true", TF: "true"},
                  server_env={XLA: "true"}),
    AllocatorCase("kernelspec-env-wins", {XLA: "false", TF: "false"},
                  spec_env={TF: "false"}),
    AllocatorCase("start-env-wins", {XLA: "true", TF: "false"},
                  start_env={XLA: "true", TF: "false"}),
    AllocatorCase("setting-off", {XLA: UNSET, TF: UNSET}, setting=False),
    AllocatorCase("setting-off-by-environment", {XLA: UNSET, TF: UNSET},
                  server_env={ENV_GROW_GPU_ALLOCATORS: "false"}),
    AllocatorCase("setting-off-keeps-the-users-value", {XLA: UNSET, TF: "false"},
                  server_env={TF: "false"}, setting=False),
]


def test_the_cases_cover_every_variable_the_provisioner_sets():
    assert set(GROWING_ALLOCATOR_ENV) == {XLA, TF}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_what_a_snapshot_ready_kernel_sees(
    case: AllocatorCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for name in (XLA, TF, ENV_GROW_GPU_ALLOCATORS):
        monkeypatch.delenv(name, raising=False)
    for name, value in case.server_env.items():
        monkeypatch.setenv(name, value)
    kwargs: dict[str, Any] = {}
    if case.spec_env:
        spec = kernel_json()
        spec["env"] = case.spec_env
        (tmp_path / KERNEL_NAME).mkdir()
        (tmp_path / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
        kwargs["kernel_spec_manager"] = KernelSpecManager(kernel_dirs=[str(tmp_path)])
    if case.setting is not None:
        kwargs["config"] = Config({"GPUSnapshot": {"grow_gpu_allocators": case.setting}})
    handle = start_kernel(**kwargs) if case.start_env is None else _started_with(
        case.start_env, kwargs
    )
    try:
        seen = handle.execute(
            f"import os; print(os.environ.get({XLA!r}, {UNSET!r}), "
            f"os.environ.get({TF!r}, {UNSET!r}))"
        ).split()
        assert dict(zip((XLA, TF), seen, strict=True)) == case.expect
    finally:
        stop_kernel(handle)


def _started_with(env: dict[str, str], kwargs: dict[str, Any]) -> KernelHandle:
    """A kernel started as jupyter_server starts one: with an env of the caller's making."""
    km = KernelManager(kernel_name=KERNEL_NAME, **kwargs)
    km.start_kernel(env={**os.environ, **env})
    client = km.blocking_client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    return KernelHandle(km, client)
