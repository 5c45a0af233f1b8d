"""Our image streamer as other image streamers are: one without our extents (criu's own
image streamer, say), or one whose extents are malformed, so that criu's fill workers take
their other way."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from jupyter_gpu_snapshot.core.store import streamer, streamer_protocol
from jupyter_gpu_snapshot.core.store.streamer_protocol import Extents


def _plain_names_only(name: str) -> streamer_protocol.Asked | None:
    """A streamer without extents sees their names as those of files it does not have."""
    return None if "@" in name else streamer_protocol.Asked(name)


@contextlib.contextmanager
def offering_no_extents() -> Iterator[None]:
    """Within, the image streamer answers no request for a pages image's extents or files."""
    offered = streamer_protocol.Asked.of
    streamer_protocol.Asked.of = staticmethod(  # type: ignore[method-assign,assignment]
        _plain_names_only)
    try:
        yield
    finally:
        streamer_protocol.Asked.of = offered  # type: ignore[method-assign]


def a_run_of_no_length(extents: Extents) -> Extents:
    """The extents, and after them a run that holds no byte."""
    file, _, off, length = extents[-1]
    return np.vstack([extents, [[file, 0, off + length, 0]]])


def the_last_run_twice(extents: Extents) -> Extents:
    """The extents with their last run repeated: two runs overlap."""
    return np.vstack([extents, extents[-1:]])


@contextlib.contextmanager
def offering_extents_changed_by(change: Callable[[Extents], Extents]) -> Iterator[None]:
    """Within, the image streamer sends criu the extents of each pages image as ``change``
    makes them."""
    send = streamer.ImageStreamer._send_extents

    def send_changed(server: streamer.ImageStreamer, image: streamer.ImageFile,
                     pipe: int) -> None:
        assert image.extents is not None  # extents are sent only of images that have them
        send(server, dataclasses.replace(image, extents=change(image.extents)), pipe)

    streamer.ImageStreamer._send_extents = send_changed  # type: ignore[method-assign]
    try:
        yield
    finally:
        streamer.ImageStreamer._send_extents = send  # type: ignore[method-assign]
