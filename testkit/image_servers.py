"""The image server as other image streamers are: one without our extents (criu's own
image streamer, say), so that criu's fill workers take their other way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jupyter_gpu_snapshot.core import image_server


def _plain_names_only(name: str) -> image_server.Asked | None:
    """A server without extents sees their names as those of files it does not have."""
    return None if "@" in name else image_server.Asked(name)


@contextlib.contextmanager
def offering_no_extents() -> Iterator[None]:
    """Within, the image server answers no request for a pages image's extents or files."""
    offered = image_server.Asked.of
    image_server.Asked.of = staticmethod(_plain_names_only)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        image_server.Asked.of = offered  # type: ignore[method-assign]
