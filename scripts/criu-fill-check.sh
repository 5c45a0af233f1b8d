#!/usr/bin/env bash
# Does this criu fill a restored process's memory on several CPUs (scripts/criu-patches),
# and does that memory come back whole? Run as root:
#
#   scripts/criu-fill-check.sh CRIU
#
# Dumps a process holding 256 MiB of patterned memory (scripts/criu-fill-check.c) in a PID
# namespace of its own, as a kernel is dumped, restores it with two fill workers asked
# for, and compares the digest of its memory before and after. Exit 0: the restore log
# says workers read the pages and the memory is the same. Exit 1, with the reason on
# stderr: a stock criu (no workers), or memory that came back wrong, or a criu that cannot
# dump or restore here. install-criu.sh runs it on every patched build before installing
# it; a criu of a version other than the patches' base is installed only if it passes.
set -euo pipefail

criu=${1:?usage: criu-fill-check.sh CRIU}
here=$(cd "$(dirname "$0")" && pwd)
MIB=256
WORKERS=2

fail() { echo "criu-fill-check: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/criu-fill-check.XXXXXX)
holder=""
pid=""
cleanup() {
    if [ -n "$holder" ] && [ -z "$pid" ]; then pid=$(pgrep -P "$holder" || true); fi
    if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
    if [ -s "$work/restored.pid" ]; then kill -9 "$(cat "$work/restored.pid")" 2>/dev/null || true; fi
    [ -n "${KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

# Waits for the file $1 that the process writes, for as long as a slow machine may need.
wait_for() {
    local i
    for i in $(seq 600); do
        [ -s "$1" ] && return 0
        sleep 0.1
    done
    return 1
}

cc -O2 -Wall -Werror -o "$work/criu-fill-check" "$here/criu-fill-check.c"

# The workers' number, where this criu has the option (scripts/criu-patches/0001-*); a criu
# without it restores on one thread, which the log check below names.
fill_args=()
if "$criu" --help 2>&1 | grep -q -- '--fill-workers'; then
    fill_args=(--fill-workers "$WORKERS")
fi

# The process is the init of a PID namespace, as a snapshot-ready kernel is: its restore
# takes no pid of this machine's, and neither do its workers.
mkdir -p "$work/images"
unshare --pid --fork setsid "$work/criu-fill-check" "$work" "$MIB" </dev/null >/dev/null 2>&1 &
holder=$!
disown  # unshare ends by the signal that ends its child: no word of it here
wait_for "$work/before" || fail "the test process wrote no digest"
pid=$(pgrep -P "$holder" -x criu-fill-check) || fail "cannot find the test process"

"$criu" dump -t "$pid" -D "$work/images" -o dump.log -v4 \
    || fail "criu dump failed: $(grep Error "$work/images/dump.log" | grep -v rlimit | head -1)"
pid=""  # criu ended it, and so unshare
holder=""

"$criu" restore -D "$work/images" -o restore.log -v4 -d \
    --pidfile "$work/restored.pid" "${fill_args[@]}" \
    || fail "criu restore failed: $(grep Error "$work/images/restore.log" | grep -v rlimit | head -1)"
kill -USR1 "$(cat "$work/restored.pid")"
wait_for "$work/after" || fail "the restored process wrote no digest"
[ "$(cat "$work/before")" = "$(cat "$work/after")" ] \
    || fail "the restored memory differs from the dumped memory"

# "Read N bytes of pages-K.img[ in place from F files] on W workers (tids from T)": the
# series' log line for each pages image its fill workers read.
workers=$(grep -oE 'Read [0-9]+ bytes of pages-[0-9]+\.img( in place from [0-9]+ files)? on [0-9]+ workers' \
    "$work/images/restore.log" | grep -oE '[0-9]+ workers$' | sort -n | tail -1 | cut -d' ' -f1 || true)
if [ -z "$workers" ] || [ "$workers" -lt 2 ]; then
    fail "criu restored the memory on one thread: it has no parallel fill"
fi
echo "criu-fill-check: $MIB MiB restored whole on $workers workers"
