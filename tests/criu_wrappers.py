"""criu stand-ins for failure tests: the real criu, killed at a chosen point."""

from __future__ import annotations

import shutil

# SIGKILLs the real criu once it is writing the kernel's memory pages: a pages image past
# 16 MiB, which the namespace's init (about 4 MiB, dumped first) never reaches. Not at any
# other moment: a criu killed in the instant it patches its parasite code into a process, or
# takes it out again, can take that process with it, and with init the whole kernel; no
# rollback can undo that (see the README's limits).
_KILL_WHILE_WRITING_PAGES = """case "$1" in dump)
  images=""; prev=""
  for arg in "$@"; do [ "$prev" = "-D" ] && images="$arg"; prev="$arg"; done
  "{real}" "$@" & pid=$!
  for i in $(seq 2000); do
    [ -n "$(find "$images" -name 'pages-*.img' -size +16M 2>/dev/null)" ] && break
    sleep 0.005
  done
  kill -9 $pid; wait $pid; exit $?;;
*) exec "{real}" "$@";;
esac
"""


def kill_while_writing_pages() -> str:
    """Body of a criu wrapper script (after its #! line)."""
    real = shutil.which("criu")
    assert real, "criu is not installed"
    return _KILL_WHILE_WRITING_PAGES.format(real=real)


# criu dying at its very end: the dump completed (its post-dump action ran) and criu ended the
# kernel, then criu is gone with SIGKILL's status before it could report success. Waiting for
# the real criu to finish makes the moment certain; the status is the one a kill there gives.
_DIES_AFTER_THE_DUMP_COMPLETED = """case "$1" in dump)
  "{real}" "$@"; exit 137;;
*) exec "{real}" "$@";;
esac
"""


def dies_after_the_dump_completed() -> str:
    """Body of a criu wrapper script (after its #! line)."""
    return _DIES_AFTER_THE_DUMP_COMPLETED.format(real=_real())


# SIGKILLs the process that runs criu (the saver, criu's parent) once criu is writing pages,
# then lets criu finish: a server or CLI killed in the middle of a dump.
_KILL_SAVER_WHILE_WRITING_PAGES = """case "$1" in dump)
  images=""; prev=""
  for arg in "$@"; do [ "$prev" = "-D" ] && images="$arg"; prev="$arg"; done
  saver=$PPID
  "{real}" "$@" & pid=$!
  for i in $(seq 2000); do
    [ -n "$(find "$images" -name 'pages-*.img' -size +16M 2>/dev/null)" ] && break
    sleep 0.005
  done
  kill -9 $saver; wait $pid; exit $?;;
*) exec "{real}" "$@";;
esac
"""

# Waits before running the real criu for the given action, so that a second operation
# surely overlaps this one.
_SLOW = """[ "$1" = "{action}" ] && sleep {seconds}
exec "{real}" "$@"
"""


def _real() -> str:
    real = shutil.which("criu")
    assert real, "criu is not installed"
    return real


def kill_saver_while_writing_pages() -> str:
    """Body of a criu wrapper script (after its #! line)."""
    return _KILL_SAVER_WHILE_WRITING_PAGES.format(real=_real())


def slow(action: str, seconds: float) -> str:
    """Body of a criu wrapper that sleeps before ``criu ACTION`` (dump or restore)."""
    return _SLOW.format(real=_real(), action=action, seconds=seconds)


# The real criu, refused a pages image past 16 MiB (the kernel's; the namespace's init stays
# under it): with SIGXFSZ ignored the write fails with EFBIG, and criu ends its dump with an
# error after it has seized the tree and its plugins checkpointed the devices.
_FAILS_WRITING_PAGES = """case "$1" in dump)
  trap '' XFSZ; ulimit -f 32768; exec "{real}" "$@";;
*) exec "{real}" "$@";;
esac
"""


def fails_writing_pages() -> str:
    """Body of a criu wrapper script (after its #! line)."""
    return _FAILS_WRITING_PAGES.format(real=_real())


# The real criu dumps and leaves the kernel running; once it has succeeded, the kernel (the
# namespace init's child) gets a signal: a kernel that dies, or freezes, right after its save.
_SIGNALS_THE_KERNEL_AFTER_THE_DUMP = """case "$1" in dump)
  root=""; prev=""
  for arg in "$@"; do [ "$prev" = "-t" ] && root="$arg"; prev="$arg"; done
  "{real}" "$@" || exit $?
  kill -{signal} $(cat /proc/$root/task/$root/children); exit 0;;
*) exec "{real}" "$@";;
esac
"""


def signals_the_kernel_after_the_dump(signal: int) -> str:
    """Body of a criu wrapper script (after its #! line)."""
    return _SIGNALS_THE_KERNEL_AFTER_THE_DUMP.format(real=_real(), signal=int(signal))
