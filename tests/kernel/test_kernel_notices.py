"""The notice a server leaves in a restored kernel (e.g. that it now runs on other GPUs):
sent with the silent request that refreshes the kernel's environment, printed once, at the
start of the user's next cell, on stderr."""

from __future__ import annotations

import asyncio
import logging

from jupyter_gpu_snapshot.server.kernel_env import refresh_kernel_env, shell_client
from tests.conftest import KernelHandle, execute

NOTICE = "This kernel was restored onto other GPUs: cuda:0 from GPU 0 to GPU 1."


def _streams(kernel: KernelHandle, code: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def hook(msg: dict[str, object]) -> None:
        if msg["msg_type"] == "stream":
            content = msg["content"]
            assert isinstance(content, dict)
            found.append((str(content["name"]), str(content["text"])))

    kernel.client.execute_interactive(code, timeout=30, output_hook=hook)
    return found


def test_the_notice_is_printed_once_before_the_next_cell(kernel: KernelHandle):
    env = {"JUPYTER_GPU_SNAPSHOT_KERNEL_ID": "new-slot"}
    log = logging.getLogger("test")
    assert asyncio.run(refresh_kernel_env(kernel.km, env, log, NOTICE))
    first = _streams(kernel, "import os; print(os.environ['JUPYTER_GPU_SNAPSHOT_KERNEL_ID'])")
    assert first[0] == ("stderr", f"Note: {NOTICE}\n")
    assert "".join(text for name, text in first if name == "stdout") == "new-slot\n"
    assert _streams(kernel, "print('again')") == [("stdout", "again\n")]
    # The silent request left nothing in the user's history: In[0] is '', then our 3 cells.
    assert execute(kernel.client, "print(len(In), 'show_at_next_cell' in globals())").split() \
        == ["4", "False"]


def test_no_notice_leaves_cells_alone(kernel: KernelHandle):
    log = logging.getLogger("test")
    assert asyncio.run(refresh_kernel_env(kernel.km, {"X_GPU_SNAPSHOT_TEST": "1"}, log))
    assert _streams(kernel, "import os; print(os.environ['X_GPU_SNAPSHOT_TEST'])") == [
        ("stdout", "1\n")]


def test_two_silent_requests_of_the_server_at_once_are_both_answered(kernel: KernelHandle):
    """The server's silent requests overlap (a restored kernel is told its slot while the
    autosave probes it): each client is answered, and neither takes the other's reply."""
    first, second = shell_client(kernel.km), shell_client(kernel.km)
    try:
        assert second.execute("second = 2", silent=True, reply=True, timeout=20)[
            "content"]["status"] == "ok"
        assert first.execute("first = 1", silent=True, reply=True, timeout=20)[
            "content"]["status"] == "ok"
    finally:
        first.stop_channels()
        second.stop_channels()
    assert execute(kernel.client, "print(first + second)").strip() == "3"
