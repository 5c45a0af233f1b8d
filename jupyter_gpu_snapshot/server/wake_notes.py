"""The note "Waking the kernel…" stays out of saved notebooks.

While a hibernated kernel wakes, its held cell shows a note with the restore's progress
(``hibernation.held_messages``); the note is cleared before the cell's own output comes. A
notebook saved meanwhile (JupyterLab's autosave comes every two minutes, and a GPU kernel's
wake can take longer) would keep it. So the note's output carries ``WAKE_NOTE`` in its
metadata, and a pre-save hook of the contents manager (``wiring`` registers it) leaves such
outputs out of the file; the page keeps showing it until the kernel answers.
"""

from __future__ import annotations

from typing import Any

# The metadata of the note's display_data, as an output of the notebook.
WAKE_NOTE: dict[str, Any] = {"jupyter_gpu_snapshot": {"wake_note": True}}


def is_wake_note(output: Any) -> bool:
    metadata = output.get("metadata") if isinstance(output, dict) else None
    ours = metadata.get("jupyter_gpu_snapshot") if isinstance(metadata, dict) else None
    return isinstance(ours, dict) and ours.get("wake_note") is True


def drop_wake_notes(model: dict[str, Any], **kwargs: Any) -> None:
    """A pre-save hook (``ContentsManager.register_pre_save_hook``): the notebook's cells
    without the waking notes."""
    content = model.get("content") if model.get("type") == "notebook" else None
    cells = content.get("cells") if isinstance(content, dict) else None
    for cell in cells if isinstance(cells, list) else []:
        outputs = cell.get("outputs") if isinstance(cell, dict) else None
        if isinstance(outputs, list) and any(is_wake_note(o) for o in outputs):
            cell["outputs"] = [o for o in outputs if not is_wake_note(o)]
