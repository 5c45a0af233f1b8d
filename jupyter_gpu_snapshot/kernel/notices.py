"""A notice the server leaves for the user of a restored kernel, shown once at its next cell.

The server (``server/kernel_slots.py``) calls ``show_at_next_cell`` through a silent
execute request right after adopting a restored kernel (a silent request's output reaches
no notebook cell). The notice is printed to the cell's stderr before the user's code runs,
then forgotten.

Only IPython and the standard library are imported: this module runs inside the kernel.
"""

from __future__ import annotations

import sys
from typing import Any


def show_at_next_cell(text: str) -> bool:
    """Print ``text`` (as a warning) at the start of the next cell; False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False

    def announce(*_info: Any) -> None:
        shell.events.unregister("pre_run_cell", announce)
        print(f"Note: {text}", file=sys.stderr, flush=True)

    shell.events.register("pre_run_cell", announce)
    return True
