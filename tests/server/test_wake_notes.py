"""A notebook saved while its kernel wakes keeps none of the note "Waking the kernel…":
the server's contents manager leaves the note's output out of the file (a pre-save hook),
whoever saves (JupyterLab's autosave comes every two minutes, a GPU kernel's wake can take
longer); the cell's other outputs stay."""

from __future__ import annotations

from typing import Any

from jupyter_gpu_snapshot.server.wake_notes import WAKE_NOTE

from .conftest import Api


def _output(text: str, metadata: dict[str, Any]) -> dict[str, Any]:
    return {"output_type": "display_data", "data": {"text/plain": text}, "metadata": metadata}


async def test_a_saved_notebook_keeps_no_waking_note(api: Api):
    cell = {"id": "c1", "cell_type": "code", "execution_count": 3, "metadata": {},
            "source": "train()",
            "outputs": [_output("Waking the kernel (restoring 1.2 GiB)…", WAKE_NOTE),
                        _output("epoch 1", {})]}
    notebook = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    await api.ok("PUT", "api", "contents", "train.ipynb", expect=201,
                 body={"type": "notebook", "content": notebook})

    saved = await api.ok("GET", "api", "contents", "train.ipynb")
    outputs = saved["content"]["cells"][0]["outputs"]
    assert [o["data"]["text/plain"] for o in outputs] == ["epoch 1"]
