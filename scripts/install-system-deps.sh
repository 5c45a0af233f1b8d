#!/usr/bin/env bash
# Debian packages the project needs at run time and for its tests. Installs only what is
# missing, so a second run does nothing (and needs no network).
set -euo pipefail

# stress-ng: `make test-under-load` runs the suite beside it. bpftrace: the node agent's
# test of its privilege rule watches every file call of the agent and criu (ptrace-free:
# strace's tracing would take criu's own ptrace from it).
needed=(util-linux iproute2 python3-venv stress-ng bpftrace)

missing=()
for pkg in "${needed[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-system-deps: please install: ${missing[*]}" >&2
    exit 1
fi
echo "install-system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
