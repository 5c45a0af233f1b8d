"""c.GPUSnapshot.grow_gpu_allocators in the server's config reaches the kernels it starts."""

from __future__ import annotations

import json

import pytest

from jupyter_gpu_snapshot._constants import GROWING_ALLOCATOR_ENV

from .conftest import Api, Json, KernelConnector


@pytest.mark.parametrize(
    "snapshot_config, expect",
    [({}, GROWING_ALLOCATOR_ENV), ({"grow_gpu_allocators": False}, {})],
    ids=["default", "off"],
)
async def test_the_servers_setting_reaches_its_kernels(
    snapshot_config: Json, expect: dict[str, str], api: Api, kernel_socket: KernelConnector,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in GROWING_ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    ws = await kernel_socket(await api.start_kernel())
    names = sorted(GROWING_ALLOCATOR_ENV)
    seen = await ws.execute(
        f"import os, json; print(json.dumps({{n: os.environ[n] for n in {names!r} "
        "if n in os.environ}))"
    )
    assert json.loads(seen) == expect
