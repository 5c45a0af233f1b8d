"""criu's log turned into one cause a person can act on (core/criu.explain_log)."""

from __future__ import annotations

from jupyter_gpu_snapshot.core.criu import explain_log


def test_a_taken_unix_socket_name_is_not_called_a_port(tmp_path):
    log = tmp_path / "restore.log"
    log.write_text("(00.512000) 1: Error (criu/sk-unix.c:1634): unix: Can't bind id 0x97 "
                   "ino 3339 addr : Address already in use\n")
    said = explain_log(log, 1)
    assert said.startswith("a Unix socket name the kernel listened on is taken"), said
    assert "port" not in said.split(";")[0]


def test_a_taken_port_is_named(tmp_path):
    log = tmp_path / "restore.log"
    log.write_text("(00.100000) Error (criu/sk-inet.c:93): inet: Can't bind inet socket "
                   "(id 5) to port 52011: Address already in use\n")
    said = explain_log(log, 1)
    assert said.startswith("a port of the kernel is in use") and "(port 52011)" in said, said
