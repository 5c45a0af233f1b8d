"""criu's log turned into one cause a person can act on (core/criu.explain_log), naming
files by their paths (CriuRunner.failure)."""

from __future__ import annotations

from jupyter_gpu_snapshot.core.criu import CriuRun, CriuRunner, explain_log


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


def test_a_file_criu_got_as_a_descriptor_is_named_by_its_path(tmp_path):
    """criu copies an inherited descriptor at each use and names the file by the copy's
    number: the message names the caller's file, whichever copy it was."""
    log = tmp_path / "restore.log"
    log.write_text(
        "(00.010000)      1: Found id file[2b:77] (fd 45) in inherit fd list\n"
        "(00.011000)      1: Found id file[2b:78] (fd 46) in inherit fd list\n"
        "(00.012000)      1: Error (criu/files-reg.c:2175): File fd/45 has bad size 12 "
        "(expect 6)\n")
    # The copy of one takes the number the other was handed as.
    argv = ["criu", "restore", "--inherit-fd", "fd[9]:file[2b:77]",
            "--inherit-fd", "fd[45]:file[2b:78]"]
    names = {"file[2b:77]": "/home/alice/out.log", "file[2b:78]": "/home/alice/read.bin"}
    said = CriuRunner.failure("restore", CriuRun(argv, 1, 0.1, log), None, names).cause
    assert "File /home/alice/out.log has bad size 12" in said, said
    assert "fd/" not in said, said


def test_without_names_criu_says_what_it_said(tmp_path):
    log = tmp_path / "restore.log"
    log.write_text("(00.012000)      1: Error (criu/files-reg.c:2175): File fd/45 has bad "
                   "size 12 (expect 6)\n")
    said = CriuRunner.failure("restore", CriuRun(["criu"], 1, 0.1, log), None).cause
    assert "File fd/45 has bad size" in said, said
