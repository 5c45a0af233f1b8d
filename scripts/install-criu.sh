#!/usr/bin/env bash
# Make sure a working CRIU >= 4.2 is on PATH, with CRIU's CUDA plugin built for it and our
# cuda-checkpoint stand-in beside it.
#
# Uses the system criu when it is new enough, `criu check` passes and the plugin was built
# for it. Otherwise builds CRIU and its CUDA plugin from Debian's source package (Debian 12's
# own criu 3.17 fails `criu check` on kernels 6.16+, and 4.1 cannot dump inet sockets there)
# and installs criu to $CRIU_PREFIX/sbin (default /usr/local). The plugin uses symbols of the
# criu binary it was built with, so it goes to $JGS_LIBDIR/criu (default
# $CRIU_PREFIX/lib/jupyter-gpu-snapshot/criu) with a note of that criu's version, and the
# stand-in (jupyter_gpu_snapshot/gpu/cuda_checkpoint_shim.c) to $JGS_LIBDIR/bin.
# apt's sources are left as they were found: the temporary deb-src entry is removed on every
# exit path.
set -euo pipefail

MIN_VERSION=4.2
PREFIX=${CRIU_PREFIX:-/usr/local}
LIBDIR=${JGS_LIBDIR:-$PREFIX/lib/jupyter-gpu-snapshot}
SRC_LIST=/etc/apt/sources.list.d/jupyter-gpu-snapshot-criu-src.sources
SHIM_SRC=$(cd "$(dirname "$0")/.." && pwd)/jupyter_gpu_snapshot/gpu/cuda_checkpoint_shim.c
# Our changes to criu, applied in name order (docs/architecture.md says why each).
PATCHES=$(cd "$(dirname "$0")" && pwd)/criu-patches
PATCHES_SUM=$(cat "$PATCHES"/*.patch | sha256sum | cut -c1-16)

log() { echo "install-criu: $*" >&2; }

version_ok() {
    local v
    v=$("$1" --version 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$v" ] || return 1
    [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$v" | sort -V | head -1)" = "$MIN_VERSION" ]
}

# The stand-in needs only a C compiler; it is rebuilt whenever its source or its flags
# change. Static: a node agent runs it inside a user's container (agent/containers.py),
# where no loader or C library of the container's may run as root.
SHIM_CFLAGS="-O2 -Wall -Werror -static"
install_shim() {
    local want have
    want=$( (echo "$SHIM_CFLAGS"; cat "$SHIM_SRC") | sha256sum | cut -d' ' -f1)
    have=$(cat "$LIBDIR/bin/.cuda-checkpoint.sha256" 2>/dev/null || true)
    if [ -x "$LIBDIR/bin/cuda-checkpoint" ] && [ "$want" = "$have" ]; then
        return 0
    fi
    command -v cc >/dev/null || { apt-get update -qq; apt-get install -y -qq build-essential >/dev/null; }
    mkdir -p "$LIBDIR/bin"
    # shellcheck disable=SC2086 # the flags are words
    cc $SHIM_CFLAGS -o "$LIBDIR/bin/cuda-checkpoint" "$SHIM_SRC"
    echo "$want" > "$LIBDIR/bin/.cuda-checkpoint.sha256"
    log "installed $LIBDIR/bin/cuda-checkpoint"
}

# What a criu built here is: its version and our patches. A criu without them (the
# system's, or one built before a patch changed) is rebuilt.
built_for() {
    echo "$("$1" --version 2>/dev/null | head -1) patches $PATCHES_SUM"
}

plugin_built_for() {
    [ -f "$LIBDIR/criu/cuda_plugin.so" ] && \
        [ "$(cat "$LIBDIR/criu/built-for" 2>/dev/null)" = "$(built_for "$1")" ]
}

existing=$(command -v criu || true)
if [ -n "$existing" ] && version_ok "$existing"; then
    if "$existing" check >/dev/null 2>&1; then
        if plugin_built_for "$existing"; then
            install_shim
            log "using $existing ($("$existing" --version | head -1)) and its CUDA plugin"
            exit 0
        fi
        log "$existing is not built with our patches and CUDA plugin; building both"
    else
        log "$existing is new enough but 'criu check' fails; building a fresh one"
    fi
fi

if [ "$(id -u)" != 0 ]; then
    log "building CRIU needs root (apt-get and install to $PREFIX); rerun as root"
    exit 1
fi

# The mirror this machine already uses; no registry host is written into the project.
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)
fi
if [ -z "$mirror" ]; then
    log "cannot find a Debian mirror in apt's sources; install criu >= $MIN_VERSION by hand"
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
log "installing build dependencies"
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
    build-essential pkg-config dpkg-dev patch xz-utils libprotobuf-dev libprotobuf-c-dev \
    protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev \
    libcap-dev libbsd-dev libgnutls28-dev libnftables-dev libaio-dev uuid-dev \
    iproute2 util-linux >/dev/null

work=$(mktemp -d /tmp/criu-build.XXXXXX)
cleanup() {
    if [ -e "$SRC_LIST" ]; then
        rm -f "$SRC_LIST"
        apt-get update -qq || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

cat > "$SRC_LIST" <<SRC
Types: deb-src
URIs: $mirror
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt-get update -qq
log "fetching the criu source package"
# The .debian.tar.xz part may be missing on the mirror; the upstream tarball is enough.
(cd "$work" && apt-get source --download-only -qq criu >/dev/null 2>&1) || true
rm -f "$SRC_LIST"
apt-get update -qq || true

orig=$(ls "$work"/criu_*.orig.tar.* 2>/dev/null | head -1 || true)
if [ -z "$orig" ]; then
    log "could not download criu's source package from $mirror (suite sid)"
    exit 1
fi
log "building $(basename "$orig")"
tar -C "$work" -xf "$orig"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | head -1)
for p in "$PATCHES"/*.patch; do
    log "applying $(basename "$p")"
    patch -s -p1 -d "$src" < "$p"
done
make -C "$src" -j"$(nproc)" criu cuda_plugin >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
install -D -m 0755 "$src/criu/criu" "$PREFIX/sbin/criu"
hash -r
log "installed $PREFIX/sbin/criu ($("$PREFIX/sbin/criu" --version | head -1))"
# criu loads every .so of its plugin directory: this one holds the CUDA plugin alone.
install -D -m 0644 "$src/plugins/cuda/cuda_plugin.so" "$LIBDIR/criu/cuda_plugin.so"
built_for "$PREFIX/sbin/criu" > "$LIBDIR/criu/built-for"
log "installed $LIBDIR/criu/cuda_plugin.so"
install_shim
if ! "$PREFIX/sbin/criu" check >/dev/null 2>&1; then
    log "warning: 'criu check' reports problems on this machine:"
    "$PREFIX/sbin/criu" check >&2 || true
fi
