"""``jupyter gpu-snapshot timeline`` and ``rewind`` on real snapshot-ready kernels, named by
their id or by their connection file, without any server: the timeline after each cell,
a value put back, the report in words and as JSON, and refusals in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_core.paths import jupyter_runtime_dir

from jupyter_gpu_snapshot.kernel.timeline import TIMELINE_OFF
from tests.conftest import KernelHandle, reply_to, start_kernel, stop_kernel


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", *args],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )


def succeeded(*args: str) -> str:
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def refused(*args: str) -> str:
    """The one line a refused command says, with its exit status checked."""
    done = cli(*args)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def named_kernel() -> Iterator[tuple[KernelHandle, str]]:
    """A snapshot-ready kernel whose connection file is where a server would write it: in
    the runtime directory, as kernel-<id>.json; and its id."""
    kernel_id = str(uuid.uuid4())
    handle = start_kernel(
        env={"JUPYTER_GPU_SNAPSHOT_TIMELINE": "on"},
        connection_file=str(Path(jupyter_runtime_dir()) / f"kernel-{kernel_id}.json"))
    try:
        yield handle, kernel_id
    finally:
        stop_kernel(handle)


def test_timeline_and_rewind_by_id_and_by_connection_file(
    named_kernel: tuple[KernelHandle, str],
) -> None:
    kernel, kernel_id = named_kernel
    kernel.execute("x = 1")
    kernel.execute("x = 2; y = [1, 2]")
    kernel.execute("y.append(3); z = 'made later'; notes = open('/dev/null')")

    timeline = json.loads(succeeded("timeline", kernel_id, "--json"))
    # What GET kernels/{id}/timeline answers (openapi.yaml's Timeline).
    assert set(timeline) == {"on", "running", "points", "rewindable", "bytes", "limit_bytes",
                             "dropped"}
    assert [p["count"] for p in timeline["points"]] == [1, 2, 3]
    assert {2, 3} <= set(timeline["rewindable"]) and timeline["running"] is False
    second, third = timeline["points"][1:]
    assert {"x", "y"} <= set(second["changed"]) and {"y", "z"} <= set(third["changed"])
    assert [u["name"] for u in third["uncopied"]] == ["notes"]
    words = succeeded("timeline", kernel_id)
    assert "[3]" in words and "not kept: notes: an open file cannot be copied" in words
    assert f"Rewind with jupyter gpu-snapshot rewind {kernel_id} --before N, N one of: " \
        in words

    connection_file = kernel.km.connection_file
    answer = json.loads(succeeded("rewind", connection_file, "--before", "3", "--json"))
    report = answer["report"]
    assert set(answer) == {"report"} and report["before"] == 3 and report["undone"] == [3]
    assert "y" in report["restored"] and {"z", "notes"} <= set(report["removed"])
    assert report["caveats"], "a rewind always says what it cannot undo"
    assert kernel.execute("print(x, y, 'z' in dir())").strip() == "2 [1, 2] False"

    # Cell [4] printed them: its point goes too.
    said = succeeded("rewind", kernel_id, "--before", "2")
    assert said.startswith("Rewound to before cell [2]: the effects of 2 cell(s) are undone "
                           "([2], [4])."), said
    assert "Put back as they were: x.\n" in said, said
    assert "Removed (they did not exist then): y." in said, said
    after = json.loads(succeeded("timeline", kernel_id, "--json"))
    assert [p["count"] for p in after["points"]] == [1]
    assert kernel.execute("print(x, 'y' in dir())").strip() == "1 False"


def test_refusals_are_one_line_with_the_step_and_a_non_zero_status(
    named_kernel: tuple[KernelHandle, str], tmp_path: Path,
) -> None:
    kernel, kernel_id = named_kernel
    kernel.execute("x = 'kept'")
    kernel.execute("x = 'newer'")
    line = refused("rewind", kernel_id, "--before", "9")
    assert line.startswith("error: rewind failed: cannot rewind to before cell 9"), line
    missing = refused("timeline", str(uuid.uuid4()))
    assert missing.startswith("error: lookup failed: no connection file kernel-"), missing
    not_a_kernel = tmp_path / "kernel-not.json"
    not_a_kernel.write_text("{}")
    line = refused("timeline", str(not_a_kernel))
    assert "lookup failed" in line and "names no control port" in line, line

    # A cell that runs until this test lets it end: the kernel refuses to rewind under it.
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    running = kernel.client.execute(f"x = 'from the cell ' + open({str(gate)!r}).read()")
    # Opening a fifo's writing end returns once its reader (the cell) has opened it.
    writer = open(gate, "w")  # noqa: SIM115 - closed below, once the refusal is seen
    try:
        line = refused("rewind", kernel_id, "--before", "2")
        assert line == ("error: rewind failed: a cell is running: wait for it or interrupt "
                        "it, then rewind"), line
        assert json.loads(succeeded("timeline", kernel_id, "--json"))["running"] is True
        assert "A cell is running now: a rewind is refused" in succeeded("timeline", kernel_id)
    finally:
        writer.write("undisturbed")
        writer.close()
    assert reply_to(kernel.client, running)["content"]["status"] == "ok"
    assert kernel.execute("print(x)").strip() == "from the cell undisturbed"


def test_a_kernel_without_a_timeline_is_told_in_seconds(tmp_path: Path) -> None:
    # A plain python3 kernel never answers a request it does not know.
    plain = start_kernel("python3")
    try:
        line = refused("rewind", plain.km.connection_file, "--before", "1")
    finally:
        stop_kernel(plain)
    assert line.startswith("error: rewind failed: the kernel did not answer the request "
                           "for its timeline within 15 s"), line
    assert "snapshot-ready kernel" in line


def test_a_kernel_whose_timeline_is_off_says_so() -> None:
    off = start_kernel()  # off unless asked
    try:
        off.execute("x = 1")
        timeline = cli("timeline", off.km.connection_file)
        as_json = cli("timeline", off.km.connection_file, "--json")
        told = refused("rewind", off.km.connection_file, "--before", "1")
    finally:
        stop_kernel(off)
    # Its timeline reads as off, with how to turn it on; a rewind is refused so.
    assert (timeline.returncode, timeline.stdout) == (0, f"{TIMELINE_OFF}\n"), timeline
    assert json.loads(as_json.stdout)["on"] is False, as_json.stdout
    assert told == f"error: rewind failed: {TIMELINE_OFF}"

