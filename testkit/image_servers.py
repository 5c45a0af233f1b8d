"""Our image streamer as other image streamers are: one that never hands a pages image
over in place (criu's own image streamer, say), or one whose extents are malformed, so
that criu reads the pages through the stream's pipe instead."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Callable, Iterator

import numpy as np

from jupyter_gpu_snapshot.core.store import streamer
from jupyter_gpu_snapshot.core.store.streamer_protocol import Extents, Request


@contextlib.contextmanager
def offering_no_extents() -> Iterator[None]:
    """Within, the image streamer reads criu's requests as a streamer that does not know
    the field asking for a file in place: every file goes through a pipe."""
    read = streamer.read_request

    def read_names_only(conn: socket.socket) -> Request | None:
        request = read(conn)
        return None if request is None else dataclasses.replace(request, in_place=False)

    streamer.read_request = read_names_only
    try:
        yield
    finally:
        streamer.read_request = read


def a_run_of_no_length(extents: Extents) -> Extents:
    """The extents, and after them a run that holds no byte."""
    file, _, off, length = extents[-1]
    return np.vstack([extents, [[file, 0, off + length, 0]]])


def the_last_run_twice(extents: Extents) -> Extents:
    """The extents with their last run repeated: two runs overlap."""
    return np.vstack([extents, extents[-1:]])


@contextlib.contextmanager
def offering_extents_changed_by(change: Callable[[Extents], Extents]) -> Iterator[None]:
    """Within, the image streamer hands criu each pages image in place with the extents
    ``change`` makes of them."""
    hand_over = streamer.ImageStreamer._hand_over

    def hand_over_changed(server: streamer.ImageStreamer, conn: socket.socket,
                          image: streamer.ImageFile, extents: Extents) -> None:
        hand_over(server, conn, image, change(extents))

    streamer.ImageStreamer._hand_over = hand_over_changed  # type: ignore[method-assign]
    try:
        yield
    finally:
        streamer.ImageStreamer._hand_over = hand_over  # type: ignore[method-assign]
