"""A real S3 server (SeaweedFS) for the remote-store tests, started once per session."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.network_gate import NetworkGate
from testkit.seaweed import SeaweedServer, serving

BUCKET = "snapshots"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    with serving(tmp_path_factory.mktemp("seaweed"), BUCKET) as server:
        yield server


@pytest.fixture
def remote_url(seaweed: SeaweedServer, request: pytest.FixtureRequest) -> str:
    """A fresh prefix in the bucket for each test."""
    test = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:40]
    return f"s3://{BUCKET}/{test}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_options(seaweed: SeaweedServer) -> dict[str, object]:
    # skip_instance_cache: each store gets its own client, as on another node.
    return dict(seaweed.storage_options(), skip_instance_cache=True)


@pytest.fixture
def cache_a(tmp_path: Path) -> Path:
    return tmp_path / "node-a"


@pytest.fixture
def cache_b(tmp_path: Path) -> Path:
    return tmp_path / "node-b"


@pytest.fixture
def gate(seaweed: SeaweedServer) -> Iterator[NetworkGate]:
    """A gate to the S3 server, shut at first: shut, the remote store cannot be reached."""
    gate = NetworkGate(seaweed.ip, seaweed.s3_port)
    try:
        yield gate
    finally:
        gate.close()
