"""criu stand-ins for failure tests: the real criu, killed at a chosen point.

Each function gives the body of a wrapper script (after its #! line); every action but the
one a wrapper is about goes to the real criu unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def install(directory: Path, body: str, name: str = "criu-wrapper") -> str:
    """Writes ``body`` (most often one of the wrappers below) as an executable shell script
    in ``directory``; its path, for ``--criu`` or ``GPUSnapshot.criu_path``."""
    script = directory / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def _real() -> str:
    real = shutil.which("criu")
    assert real, "criu is not installed"
    return real


def _on_dump(script: str, **values: object) -> str:
    """A wrapper that runs ``script`` for ``criu dump``; "{real}" in it is the real criu."""
    wrapper = 'case "$1" in dump)\n' + script + ';;\n*) exec "{real}" "$@";;\nesac\n'
    return wrapper.format(real=_real(), **values)


def _value_of(option: str, name: str) -> str:
    """Shell lines that set ``name`` to the value of criu's ``option`` in "$@"."""
    return (
        f'  {name}=""; prev=""\n'
        f'  for arg in "$@"; do [ "$prev" = "{option}" ] && {name}="$arg"; prev="$arg"; done\n'
    )


# Once criu writes the kernel's memory pages: a pages image past 16 MiB, which the
# namespace's init (about 4 MiB, dumped first) never reaches.
_UNTIL_WRITING_PAGES = (
    _value_of("-D", "images")
    + """  "{real}" "$@" & pid=$!
  for i in $(seq 2000); do
    [ -n "$(find "$images" -name 'pages-*.img' -size +16M 2>/dev/null)" ] && break
    sleep 0.005
  done
"""
)


def kill_while_writing_pages() -> str:
    """SIGKILLs the real criu once it is writing the kernel's memory pages.

    Not at any other moment: a criu killed in the instant it patches its parasite code into
    a process, or takes it out again, can take that process with it, and with init the
    whole kernel; no rollback can undo that (see the README's limits).
    """
    return _on_dump(_UNTIL_WRITING_PAGES + "  kill -9 $pid; wait $pid; exit $?")


def dies_after_the_dump_completed() -> str:
    """criu dying at its very end: the dump completed (its post-dump action ran) and criu
    ended the kernel, then criu is gone with SIGKILL's status before it could report
    success. Waiting for the real criu to finish makes the moment certain; the status is
    the one a kill there gives."""
    return _on_dump('  "{real}" "$@"; exit 137')


def pauses_after_the_dump(seconds: float) -> str:
    """The real criu dumps and leaves the kernel running, then waits ``seconds`` before it
    reports: the kernel runs again while its save is still under way, for a while that
    does not depend on how fast the machine is."""
    return _on_dump('  "{real}" "$@"; status=$?; sleep {seconds}; exit $status', seconds=seconds)


def waits_after_the_dump_for(gate: str, limit_seconds: int = 300) -> str:
    """The real criu dumps and leaves the kernel running, then reports only once the file
    ``gate`` exists (or after ``limit_seconds``): the save stays under way until the test
    has seen what it waits for, however slow the machine."""
    return _on_dump(
        '  "{real}" "$@"; status=$?\n'
        "  for i in $(seq {ticks}); do [ -e '{gate}' ] && break; sleep 0.1; done\n"
        "  exit $status",
        gate=gate, ticks=limit_seconds * 10,
    )


def kill_saver_while_writing_pages() -> str:
    """SIGKILLs the process that runs criu (the saver, criu's parent) once criu is writing
    pages, then lets criu finish: a server or CLI killed in the middle of a dump."""
    return _on_dump(
        "  saver=$PPID\n" + _UNTIL_WRITING_PAGES + "  kill -9 $saver; wait $pid; exit $?"
    )


# Waits before running the real criu for the given action, so that a second operation
# surely overlaps this one.
_SLOW = """[ "$1" = "{action}" ] && sleep {seconds}
exec "{real}" "$@"
"""


def slow(action: str, seconds: float) -> str:
    """A wrapper that sleeps before ``criu ACTION`` (dump or restore)."""
    return _SLOW.format(real=_real(), action=action, seconds=seconds)


def waits_before(action: str, gate: str, limit_seconds: int = 300) -> str:
    """A wrapper that runs ``criu ACTION`` (dump or restore) only once the file ``gate``
    exists (or after ``limit_seconds``): the operation holds its locks until the test has
    done what must overlap it, however slow the machine or busy its other processes."""
    return (
        f'if [ "$1" = {action} ]; then\n'
        f"  for i in $(seq {limit_seconds * 10}); do [ -e '{gate}' ] && break; sleep 0.1; done\n"
        f'fi\nexec "{_real()}" "$@"\n'
    )


def gated(directory: Path, action: str) -> tuple[str, Path]:
    """A ``waits_before`` criu installed in ``directory``, and its gate: the test creates
    the gate file once what must overlap the operation is done."""
    gate = directory / f"{action}-may-start"
    return install(directory, waits_before(action, str(gate)), f"criu-gated-{action}"), gate


def fails_writing_pages() -> str:
    """The real criu, refused a pages image past 16 MiB (the kernel's; the namespace's init
    stays under it): with SIGXFSZ ignored the write fails with EFBIG, and criu ends its dump
    with an error after it has seized the tree and its plugins checkpointed the devices."""
    return _on_dump("  trap '' XFSZ; ulimit -f 32768; exec \"{real}\" \"$@\"")


def signals_the_kernel_after_the_dump(signal: int) -> str:
    """The real criu dumps and leaves the kernel running; once it has succeeded, the kernel
    (the namespace init's child) gets ``signal``: a kernel that dies, or freezes, right
    after its save."""
    return _on_dump(
        _value_of("-t", "root")
        + '  "{real}" "$@" || exit $?\n'
        + "  kill -{signal} $(cat /proc/$root/task/$root/children); exit 0",
        signal=int(signal),
    )


def fails_restoring_while(marker: Path) -> str:
    """The real criu, except that ``criu restore`` fails at once while ``marker`` exists:
    an image whose restore fails on this node (as one would on a new driver), and only
    while the test wants it to."""
    return (f'if [ "$1" = restore ] && [ -e "{marker}" ]; then\n'
            '  echo "Error (criu/cr-restore.c): restore refused by the test" >&2; exit 1\n'
            f'fi\nexec "{_real()}" "$@"\n')


def keeps_the_restore_log(copy_to: Path, fill_workers: int | None = None,
                          real: str | None = None) -> str:
    """The real criu (or ``real``), whose ``criu restore`` log is copied to ``copy_to`` when
    it ends (the engine removes criu's working directory), with ``--fill-workers``
    (scripts/criu-patches) when given."""
    criu = real or _real()
    workers = f" --fill-workers {fill_workers}" if fill_workers is not None else ""
    return (
        'case "$1" in restore)\n'
        + _value_of("-W", "work")
        + f'  "{criu}" "$@"{workers}; rc=$?\n'
        + f'  cp "$work/restore.log" "{copy_to}"; exit $rc;;\n'
        + f'*) exec "{criu}" "$@";;\nesac\n'
    )
