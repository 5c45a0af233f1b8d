"""The kernel side of the portable fallback, in real kernels: a portable copy asked for over
the control channel and loaded by a second, fresh kernel the way the server loads it,
compared bit for bit; the recorded cells; and user code held still while a copy is written.

Plain ``python3`` kernels (no snapshot provisioner), real files in the test's directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jupyter_client.blocking import BlockingKernelClient
from safetensors import safe_open

from jupyter_gpu_snapshot.kernel.portable import (
    FILE_NAME,
    REPORT_FILE,
    TENSOR_FILE,
    load_portable,
)
from tests.conftest import KernelHandle, execute, start_kernel, stop_kernel, wait_for_output

pytestmark = pytest.mark.timeout(90)

INSTALL = "from jupyter_gpu_snapshot.kernel import cell_record; cell_record.install(get_ipython())"

# Run in both kernels: what every array looks like, bit for bit, as JSON.
DIGEST = """
import hashlib as _hashlib, json as _json
import numpy as _np, pandas as _pd

def _digest(value):
    array = _np.ascontiguousarray(value)
    return [array.dtype.str, list(array.shape), _hashlib.sha256(array.tobytes()).hexdigest()]

print(_json.dumps({
    "weights": _digest(weights), "counts": _digest(counts), "mask": _digest(mask),
    "half": _digest(half), "big_endian": _digest(big_endian), "when": _digest(when),
    "wide": _digest(wide), "scalar": _digest(scalar),
    "store.extra": _digest(store["extra"]), "acc.total": _digest(acc.total),
    "frame": [str(frame.dtypes.to_dict()), list(frame.columns),
              _digest(_pd.util.hash_pandas_object(frame, index=True).to_numpy()),
              _digest(frame[["x", "n"]].to_numpy())],
}))
"""


def control(client: BlockingKernelClient, msg_type: str, content: dict[str, Any]) -> str:
    """Send a request on the control channel; its message id."""
    msg = client.session.msg(msg_type, content)
    client.control_channel.send(msg)
    return str(msg["header"]["msg_id"])


def control_reply(client: BlockingKernelClient, msg_id: str,
                  timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no control reply to {msg_id} in {timeout}s"
        reply: dict[str, Any] = client.control_channel.get_msg(timeout=left)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def request(client: BlockingKernelClient, msg_type: str, content: dict[str, Any],
            timeout: float = 60) -> dict[str, Any]:
    return control_reply(client, control(client, msg_type, content), timeout)


def load_like_the_server(client: BlockingKernelClient, directory: Path) -> dict[str, Any]:
    """What the server runs in a fresh kernel: a silent request whose user expression loads
    the copy; the result comes back as JSON."""
    expression = (
        "__import__('jupyter_gpu_snapshot.kernel.portable', fromlist=['load_into_kernel'])"
        f".load_into_kernel({str(directory)!r})"
    )
    reply = client.execute("", silent=True, store_history=False,
                           user_expressions={"portable": expression}, reply=True, timeout=60)
    result = reply["content"]["user_expressions"]["portable"]
    assert result["status"] == "ok", result
    as_json: dict[str, Any] = result["data"]["application/json"]
    assert json.loads(result["data"]["text/plain"]) == as_json
    return as_json


def run_async(client: BlockingKernelClient, code: str) -> str:
    """Send a cell without waiting for it; its message id."""
    return str(client.execute(code, store_history=True))


def stdout_of(client: BlockingKernelClient, msg_id: str, timeout: float = 60) -> str:
    """Everything cell ``msg_id`` printed on stdout, once it has gone idle."""
    deadline = time.monotonic() + timeout
    printed = ""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"cell {msg_id} did not finish in {timeout}s: {printed!r}"
        msg = client.get_iopub_msg(timeout=left)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            printed += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return printed


@pytest.fixture
def kernels() -> Iterator[list[KernelHandle]]:
    """Plain python3 kernels started on demand (see ``new_kernel``), ended afterwards."""
    started: list[KernelHandle] = []
    yield started
    for handle in started:
        stop_kernel(handle)


def new_kernel(kernels: list[KernelHandle], tmp_path: Path) -> KernelHandle:
    # IPython's history database of these kernels stays in the test's directory.
    ipython_dir = tmp_path / f"ipython-{len(kernels)}"
    handle = start_kernel("python3", env={"IPYTHONDIR": str(ipython_dir)})
    kernels.append(handle)
    return handle


def test_a_second_kernel_loads_the_copy_bit_for_bit(
    kernels: list[KernelHandle], tmp_path: Path
) -> None:
    first = new_kernel(kernels, tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    log_path = tmp_path / "log.txt"
    execute(first.client, INSTALL)
    execute(first.client, "import numpy as np\nimport pandas as pd")
    execute(first.client, f"""
        rng = np.random.default_rng(7)
        weights = rng.standard_normal((64, 32)).astype(np.float32)
        counts = np.arange(10, dtype=np.int64)
        mask = weights > 0
        half = weights.astype(np.float16)[::2, 1::3]    # a view, not contiguous
        big_endian = np.arange(6, dtype=">f8").reshape(2, 3)
        when = np.array(["2024-01-01T12:00", "2024-06-30"], dtype="datetime64[ns]")
        wide = (rng.standard_normal(4) + 1j).astype(np.complex128)
        scalar = np.array(3.5)
        frame = pd.DataFrame({{"x": rng.standard_normal(5), "n": np.arange(5),
                              "label": list("abcde"),
                              "t": pd.date_range("2024-01-01", periods=5)}})
        store = {{"weights": weights, "extra": rng.standard_normal(3), "nested": [counts]}}
        offset = 1
        def scale(x, k=2):
            return x * k + offset
        class Accumulator:
            def __init__(self):
                self.total = np.zeros(4)
                self.steps = 0
            def add(self, value):
                self.total += value
                self.steps += 1
                return self
        acc = Accumulator().add(np.ones(4))
        log = open({str(log_path)!r}, "w")
        numbers = (i * i for i in range(10))
        """)
    before = json.loads(execute(first.client, DIGEST))

    reply = request(first.client, "gpu_snapshot_portable_request", {"directory": str(copy)})
    assert reply["msg_type"] == "gpu_snapshot_portable_reply"
    assert reply["content"]["status"] == "ok", reply["content"]
    report = reply["content"]["portable"]

    # Every file it lists exists, is named as promised, and nothing else was written.
    assert sorted(report["files"]) == sorted(p.name for p in copy.iterdir())
    assert all(FILE_NAME.match(name) and name.startswith("portable.") for name in report["files"])
    assert TENSOR_FILE in report["files"] and REPORT_FILE in report["files"]
    assert json.loads((copy / REPORT_FILE).read_text()) == report
    assert report["bytes"] == sum((copy / f).stat().st_size for f in report["files"]
                                  if f != REPORT_FILE)
    # The tensor file is a standard one: safetensors reads it. The weights shared by two
    # names are in it once.
    with safe_open(str(copy / TENSOR_FILE), framework="numpy") as handle:
        stored = [handle.get_tensor(key) for key in list(handle.keys())]
    assert sum(1 for a in stored if a.shape == (64, 32) and a.dtype == np.float32) == 1

    carried = {entry["name"]: entry for entry in report["carried"]}
    assert {"weights", "frame", "store", "scale", "Accumulator", "acc", "np", "pd"} <= set(carried)
    assert carried["np"]["kind"] == "module" and carried["np"]["module"] == "numpy"
    assert carried["scale"]["kind"] == "function"
    assert carried["Accumulator"]["kind"] == "class"
    assert carried["weights"]["kind"] == "numpy.ndarray"
    assert carried["weights"]["devices"] == ["cpu"]
    assert carried["weights"]["bytes"] >= 64 * 32 * 4
    not_carried = {entry["name"]: entry["reason"] for entry in report["not_carried"]}
    assert not_carried == {"log": "an open file", "numbers": "a generator"}
    assert not {"In", "Out", "get_ipython", "exit", "quit"} & set(carried)

    second = new_kernel(kernels, tmp_path)
    loaded = load_like_the_server(second.client, copy)
    assert {item["name"] for item in loaded["loaded"]} == set(carried)
    assert {item["name"]: item["reason"] for item in loaded["not_loaded"]} == {
        "log": "not carried: an open file", "numbers": "not carried: a generator"}
    assert loaded["notes"] == []

    assert json.loads(execute(second.client, DIGEST)) == before
    checks = execute(second.client, """
        print(store["weights"] is weights, store["nested"][0] is counts,
              scale(np.float64(2)), type(acc) is Accumulator, acc.add(np.ones(4)).steps,
              "log" in globals(), "numbers" in globals(), np.__name__, pd.__name__)
        """).split()
    assert checks == ["True", "True", "5.0", "True", "2", "False", "False", "numpy", "pandas"]
    # Nothing but the loaded names landed in the fresh kernel's namespace.
    assert execute(second.client, "print(sorted(k for k in globals() if k.startswith('load')))"
                   ) == "[]\n"


def test_the_cells_request_lists_counts_sources_and_defined_names(
    kernels: list[KernelHandle], tmp_path: Path
) -> None:
    kernel = new_kernel(kernels, tmp_path)
    client = kernel.client
    execute(client, INSTALL)  # count 1: the cell that installs is not recorded
    sources = {
        2: "x = 1",
        3: "x = x + 1",
        4: "items = [x]",
        5: "items.append(3)",
        6: "def f():\n    return x",
    }
    for source in sources.values():
        execute(client, source)
    # Neither a silent execution nor one without history is a cell.
    assert client.execute("hidden = 5", silent=True, reply=True)["content"]["status"] == "ok"
    assert client.execute("unrecorded = 6", store_history=False,
                          reply=True)["content"]["status"] == "ok"
    failing = client.execute("1 / 0", reply=True)  # 7
    assert failing["content"]["status"] == "error"
    execute(client, "y, x = x, 10")  # 8
    execute(client, "")  # an empty cell has no count

    reply = request(client, "gpu_snapshot_cells_request", {})
    assert reply["msg_type"] == "gpu_snapshot_cells_reply"
    content = reply["content"]
    assert content["status"] == "ok" and content["complete"] is True
    assert "omitted" not in content
    cells = content["cells"]
    assert [c["count"] for c in cells] == [2, 3, 4, 5, 6, 7, 8]
    assert [c["source"] for c in cells[:5]] == list(sources.values())
    assert cells[5]["source"] == "1 / 0" and cells[6]["source"] == "y, x = x, 10"
    assert [sorted(c["defined"]) for c in cells] == [
        ["x"], ["x"], ["items"], [], ["f"], [], ["x", "y"]]
    assert [c["ok"] for c in cells] == [True] * 5 + [False, True]

    # Beyond 2 MiB of sources the newest cells are kept.
    big = "a" * (1200 * 1024)
    execute(client, f"first_blob = {big!r}")  # 9
    execute(client, f"second_blob = {big!r}")  # 10
    content = request(client, "gpu_snapshot_cells_request", {})["content"]
    assert content["complete"] is False
    assert [c["count"] for c in content["cells"]] == [10]
    assert content["omitted"] == 8
    assert content["cells"][0]["defined"] == ["second_blob"]

    # A cell may write a copy itself, without waiting for itself to end.
    copy = tmp_path / "from-a-cell"
    copy.mkdir()
    written = execute(client, f"""
        from pathlib import Path
        from jupyter_gpu_snapshot.kernel import portable_request
        report = portable_request.write_held(Path({str(copy)!r}), timeout=10)
        print(sorted(entry["name"] for entry in report["carried"]))
        """)
    assert "'items'" in written and "'second_blob'" in written

    # Installing again changes nothing: one recorder follows the cells.
    execute(client, INSTALL)
    assert execute(client, """
        print(sum(type(getattr(f, "__self__", None)).__name__ == "CellRecorder"
                  for f in get_ipython().events.callbacks["post_run_cell"]))
        """) == "1\n"


def test_the_copy_waits_for_the_running_cell_and_the_next_cell_waits_for_the_copy(
    kernels: list[KernelHandle], tmp_path: Path
) -> None:
    kernel = new_kernel(kernels, tmp_path)
    client = kernel.client
    execute(client, INSTALL)
    # An object that takes a second to pickle, and says when it started and ended, so the
    # copy lasts long enough for a cell to arrive while it is written.
    execute(client, """
        import os, time
        import numpy as np
        a = np.zeros(8)
        flag_path = None
        class Slow:
            def __reduce__(self):
                global _slow_started, _slow_done
                _slow_started = time.time()
                open(flag_path, "w").close()
                time.sleep(1.0)
                _slow_done = time.time()
                return (Slow, ())
        slow = Slow()
        """)

    # 1. The request comes while a cell runs, which then mutates `a`: the copy holds its end
    # state. The cell mutates it only once the copy waits for it to end.
    first_copy = tmp_path / "first"
    first_copy.mkdir()
    execute(client, f"flag_path = {str(tmp_path / 'first.flag')!r}")
    loop = run_async(client, """
        from jupyter_gpu_snapshot.kernel import portable_request
        print("started", flush=True)
        while not portable_request._GATE._waiting_writers:
            time.sleep(0.01)
        for _ in range(20):
            a += 1
        """)
    wait_for_output(client, loop, "started", 30, "stdout")
    portable = control(client, "gpu_snapshot_portable_request", {"directory": str(first_copy)})
    following = run_async(client, "print(time.time(), a[0])")
    reply = control_reply(client, portable)
    assert reply["content"]["status"] == "ok", reply["content"]
    namespace: dict[str, Any] = {}
    loaded = load_portable(namespace, first_copy, reply["content"]["portable"])
    assert "a" in {item["name"] for item in loaded["loaded"]}, loaded
    assert namespace["a"].tolist() == [20.0] * 8
    # The cell sent while the copy was written started only once it was done.
    started_at, seen = stdout_of(client, following).split()
    slow_done = float(execute(client, "print(_slow_done)"))
    assert float(started_at) >= slow_done
    assert float(seen) == 20.0

    # 2. A parked cell lets the copy be written meanwhile, and waits for it to end.
    parked_copy = tmp_path / "parked"
    parked_copy.mkdir()
    parked_flag = tmp_path / "parked.flag"
    execute(client, f"flag_path = {str(parked_flag)!r}")
    cell = run_async(client, f"""
        from jupyter_gpu_snapshot.kernel import portable_request
        b = 1
        print("parked", flush=True)
        with portable_request.parked():
            while not os.path.exists({str(parked_flag)!r}):
                time.sleep(0.01)
        after_parked = time.time()
        b = 2
        """)
    wait_for_output(client, cell, "parked", 30, "stdout")
    reply = request(client, "gpu_snapshot_portable_request", {"directory": str(parked_copy)})
    assert reply["content"]["status"] == "ok", reply["content"]
    namespace = {}
    load_portable(namespace, parked_copy, reply["content"]["portable"])
    assert namespace["b"] == 1
    assert "after_parked" not in namespace
    stdout_of(client, cell)
    after, slow_done = execute(client, "print(after_parked, _slow_done)").split()
    assert float(after) >= float(slow_done)
    assert execute(client, "print(b)") == "2\n"


def test_interrupting_a_cell_that_waits_abandons_the_copy(
    kernels: list[KernelHandle], tmp_path: Path
) -> None:
    kernel = new_kernel(kernels, tmp_path)
    client = kernel.client
    flag = tmp_path / "writing.flag"
    execute(client, INSTALL)
    # The copy lasts until the interrupt below has abandoned it, however late that comes.
    execute(client, f"""
        import os, time
        import numpy as np
        from jupyter_gpu_snapshot.kernel import portable_request
        a = np.ones(4)
        class Slow:
            def __reduce__(self):
                if not portable_request._GATE._writing:  # the timeline's copy after a cell
                    return (Slow, ())
                open({str(flag)!r}, "w").close()
                deadline = time.monotonic() + 60
                while not portable_request._GATE.abandoned and time.monotonic() < deadline:
                    time.sleep(0.01)
                return (Slow, ())
        slow = Slow()
        """)
    copy = tmp_path / "copy"
    copy.mkdir()
    # A copy that may wait only so long for a running cell gives up; the cell runs until
    # the copy has given up.
    released = tmp_path / "released.flag"
    sleeping = run_async(client, f"""
        print('sleeping', flush=True)
        while not os.path.exists({str(released)!r}):
            time.sleep(0.01)
        """)
    wait_for_output(client, sleeping, "sleeping", 30, "stdout")
    reply = request(client, "gpu_snapshot_portable_request",
                    {"directory": str(copy), "wait_seconds": 0.2})
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "CellStillRunning"
    released.touch()
    stdout_of(client, sleeping)

    portable = control(client, "gpu_snapshot_portable_request", {"directory": str(copy)})
    deadline = time.monotonic() + 30
    while not flag.exists():
        assert time.monotonic() < deadline, "the copy did not start"
        time.sleep(0.01)
    waiting = client.execute("print('ran')")
    # The cell says that it waits for the copy, after a second.
    wait_for_output(client, waiting, "Waiting for a portable copy", 30, "stderr")
    kernel.km.interrupt_kernel()
    reply = control_reply(client, portable)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "PortableCopyAbandoned"
    assert [p.name for p in copy.iterdir()] == []
    # The interrupted cell ran once the copy had stopped.
    assert stdout_of(client, waiting) == "ran\n"
