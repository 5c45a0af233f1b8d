"""A TCP gate in front of the S3 server: open, it forwards every connection; shut, it
drops every connection at once, as a remote store that went down or out of reach does."""

from __future__ import annotations

import contextlib
import socket
import threading


class NetworkGate:
    """Listens on loopback and forwards to ``target`` while open; ``url`` is its endpoint."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.is_open = threading.Event()
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="gate").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        self.is_open.set()

    def shut(self) -> None:
        """Drop the connections that pass now, and every new one until ``open``."""
        self.is_open.clear()
        with self._lock:
            live, self._live = self._live, set()
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed = True
        self.shut()
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.is_open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._live |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pipe, args=(source, sink), daemon=True, name="gate-pipe"
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._live -= {source, sink}
