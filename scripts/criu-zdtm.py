#!/usr/bin/python3
"""CRIU's own scenarios (zdtm) on a criu built by scripts/install-criu.sh. Run as root:

    scripts/criu-zdtm.py [--tree TREE] [--workers 1 4] [--out FILE] [--against FILE]

TREE is the build tree of the criu to test (default: the installed criu's, which its
``built-for`` note names); zdtm and its scenarios are built in that tree, from the same
source, once. Each scenario of scripts/criu-zdtm.list runs with each count of fill workers
(``--fill-workers`` on criu's restores; a stock criu runs each once, without it): first
with the most, then with the others where that restore's log says the fill workers read
its pages. Elsewhere (no private memory with pages in the image) criu restores the same
way whatever the count. ``--out`` writes the results (the criu, its source, the date, the
machine, and one line per run); ``--against`` names the results of stock criu: a scenario
that passes there and fails here is a bug in our patches, and is named as one. Exit 1 when
any run failed; a scenario zdtm skips (a kernel feature missing), or one of the series'
own that this source lacks, is shown as skipped. Debian's python3 runs zdtm
(python3-yaml, python3-protobuf).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIST = HERE / "criu-zdtm.list"
# zdtm's own tools run from its directory through "python3" and "ip": Debian's, not a
# python of the caller's PATH that lacks yaml and protobuf.
ENV_PATH = "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
# The scenarios with MAP_HUGETLB need huge pages reserved; a run reserves them, and gives
# back what it reserved.
HUGE_PAGES = 64
# "Read N bytes of pages-K.img[ in place from F files] on W workers (tids from T)", or "on
# 1 worker": the series' line for each pages image its fill workers read.
FILLED = re.compile(rb"Read \d+ bytes of pages-\d+\.img(?: in place from \d+ files)? "
                    rb"on (\d+) workers?")
# criu's log lines begin with the seconds since it started: "(01.043327) ...".
STAMP = re.compile(rb"^\((\d+\.\d+)\)", re.M)
RESULT = re.compile(r"Test (\S+) (PASS|FAIL at .*?) *[=#]*$")
SKIPPED = re.compile(r"^Skipping (\S+) \((.*)\)$", re.M)


def installed_tree() -> Path:
    prefix = os.environ.get("CRIU_PREFIX", "/usr/local")
    libdir = Path(os.environ.get("JGS_LIBDIR", f"{prefix}/lib/jupyter-gpu-snapshot"))
    note = libdir / "criu" / "built-for"
    for line in note.read_text().splitlines():
        if line.startswith("tree: "):
            return Path(line.removeprefix("tree: "))
    sys.exit(f"criu-zdtm: {note} names no build tree; run scripts/install-criu.sh")


def scenarios() -> list[tuple[str, str]]:
    found = []
    for line in LIST.read_text().splitlines():
        words = line.split("#")[0].split()
        if words:
            found.append((words[0], words[1]))
    return found


def run(argv: list[str], **kw: object) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]


def prepare(tree: Path) -> None:
    """zdtm's library, pycriu's images and zdtm's helpers, built once in the tree (each
    scenario is built by zdtm when it first runs)."""
    if not (tree / ".zdtm-built").exists():
        print(f"criu-zdtm: building zdtm in {tree}", flush=True)
        run(["make", "-C", str(tree), f"-j{os.cpu_count()}", "lib"])
        run(["make", "-C", str(tree / "test/zdtm/lib"), f"-j{os.cpu_count()}"])
        run(["make", "-C", str(tree / "test"), "umount2", "zdtm_ct"])
        (tree / ".zdtm-built").touch()


def has_fill_workers(criu: Path) -> bool:
    """Whether ``criu`` has the series' ``--fill-workers`` (scripts/criu-patches/0001-*)."""
    out = subprocess.run([str(criu), "--help"], capture_output=True, text=True).stdout
    return "--fill-workers" in out


def criu_bin(tree: Path, workers: int | None, work: Path) -> Path:
    """The criu zdtm runs: the tree's, with ``--fill-workers`` on its restores when
    ``workers`` is given."""
    criu = tree / "criu" / "criu"
    if workers is None:
        return criu
    wrapper = work / f"criu-{workers}-workers"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = restore ]; then exec {criu} "$@" --fill-workers {workers}; fi\n'
        f'exec {criu} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def run_one(tree: Path, test: str, flavour: str, workers: int | None,
            work: Path) -> tuple[str, float, float | None, int | None, str]:
    """(PASS / FAIL at STEP, seconds of the whole run, seconds of criu's restores, the most
    workers a restore's fill used (None: no fill line in any restore log), the output's
    tail)."""
    if not (tree / "test" / f"{test}.c").exists():
        # A scenario of the patch series itself, absent from other sources.
        return "SKIP (not in this source)", 0.0, None, None, ""
    dump = tree / "test" / "dump"
    shutil.rmtree(dump, ignore_errors=True)
    env = {**os.environ, "PATH": ENV_PATH}
    argv = ["/usr/bin/python3", "zdtm.py", "run", "-t", test, "-f", flavour, "-k", "always",
            "--criu-bin", str(criu_bin(tree, workers, work))]
    started = time.monotonic()
    out = subprocess.run(argv, cwd=tree / "test", env=env, capture_output=True, text=True,
                         errors="replace")
    took = time.monotonic() - started
    text = out.stdout + out.stderr
    results = [m.group(2).strip() for m in map(RESULT.search, text.splitlines()) if m]
    result = results[-1] if results else "FAIL at start (zdtm ran no test)"
    skipped = SKIPPED.search(text)
    if skipped and not results:
        result = f"SKIP ({skipped.group(2)})"
    logs = [log.read_bytes() for log in dump.rglob("restore.log")]
    seen = [int(n) for log in logs for n in FILLED.findall(log)]
    restoring = sum(float(STAMP.findall(log)[-1]) for log in logs if STAMP.search(log))
    shutil.rmtree(dump, ignore_errors=True)
    return result, took, restoring if logs else None, max(seen) if seen else None, text[-3000:]


def note_lines(tree: Path) -> list[str]:
    criu = tree / "criu" / "criu"
    version = subprocess.run([str(criu), "--version"], capture_output=True,
                             text=True).stdout.splitlines()[0]
    mode = (tree / ".mode").read_text().strip() if (tree / ".mode").exists() else "?"
    source = (tree / ".source").read_text().strip() if (tree / ".source").exists() else "?"
    return [f"# criu: {version}, {mode}; source {source}",
            f"# date: {datetime.date.today()}; machine: Linux {platform.release()} "
            f"{platform.machine()}, {os.cpu_count()} CPUs"]


def reserve_huge_pages() -> int | None:
    """Reserves HUGE_PAGES huge pages if fewer are; the number there was, to give back."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    before = int(knob.read_text())
    if before >= HUGE_PAGES:
        return None
    knob.write_text(str(HUGE_PAGES))
    return before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--against", type=Path)
    parser.add_argument("-t", "--test", action="append", help="only these scenarios")
    args = parser.parse_args()
    tree = args.tree or installed_tree()
    stock = (tree / ".mode").exists() and (tree / ".mode").read_text().strip() == "stock"
    if not stock and not has_fill_workers(tree / "criu" / "criu"):
        sys.exit(f"criu-zdtm: {tree}'s criu has no --fill-workers: not a build of "
                 "scripts/criu-patches")
    counts: list[int | None] = [None] if stock else list(args.workers)
    counts_desc = sorted(counts, key=lambda n: -(n or 0))
    prepare(tree)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"criu-zdtm.{os.getpid()}"
    work.mkdir()
    given_back = reserve_huge_pages()
    lines = [*note_lines(tree),
             "# test flavour workers result seconds restore-seconds workers-seen"]
    failed: list[str] = []
    try:
        for test, flavour in scenarios():
            if args.test and test not in args.test and test.split("/")[-1] not in args.test:
                continue
            workers_seen: int | None = None
            # The most workers first: a scenario whose restores' logs have no fill line
            # (no private pages the workers read) restores the same with one, so it runs
            # with the others only when its log has one.
            for workers in counts_desc:
                if workers != counts_desc[0] and workers_seen is None:
                    continue
                result, took, restoring, seen, tail = run_one(tree, test, flavour, workers,
                                                              work)
                if workers == counts_desc[0]:
                    workers_seen = seen
                shown = "-" if workers is None else str(workers)
                line = (f"{test} {flavour} {shown} {result.replace(' ', '_')} {took:.1f} "
                        f"{'-' if restoring is None else f'{restoring:.2f}'} "
                        f"{seen if seen is not None else '-'}")
                print(f"criu-zdtm: {line}", flush=True)
                lines.append(line)
                if result.startswith("FAIL"):
                    failed.append(f"{test} ({flavour}, workers {shown}): {result}")
                    print(tail, file=sys.stderr)
    finally:
        if given_back is not None:
            Path("/proc/sys/vm/nr_hugepages").write_text(str(given_back))
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if args.against and failed:
        passed_there = {line.split()[0] for line in args.against.read_text().splitlines()
                        if not line.startswith("#") and line.split()[3] == "PASS"}
        for failure in failed:
            if failure.split()[0] in passed_there:
                print(f"criu-zdtm: a bug in our patches: {failure} passes on stock criu "
                      f"({args.against.name})", file=sys.stderr)
    for failure in failed:
        print(f"criu-zdtm: FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
