#!/usr/bin/env bash
# Make sure a working CRIU >= 4.2 is installed, with CRIU's CUDA plugin built for it and our
# cuda-checkpoint stand-in beside it; with our patches (scripts/criu-patches: memory filled
# on several CPUs) where they fit, else stock. docs/criu.md tells the whole behaviour.
#
#   scripts/install-criu.sh          install (or keep what is installed and still right)
#   scripts/install-criu.sh source   print the path of the patches' base source, fetched
#                                    and checked (for builds of the tests)
#
# The patches were made for one source, BASE_VERSION with the tarball BASE_SHA256. That
# source is fetched from Debian's source packages (the suites in SUITES, while any has it)
# or, when no suite has it any more, the newest criu they have. Any other source, or a
# given one that is not it, gets the patches applied with no fuzz, a build and a self-check
# (scripts/criu-fill-check.sh); if any of them fails, stock criu is built instead: the
# product works with it, its restores are slower. criu goes to $CRIU_PREFIX/sbin (default
# /usr/local); the plugin uses symbols of the criu it was built with, so it goes to
# $JGS_LIBDIR/criu (default $CRIU_PREFIX/lib/jupyter-gpu-snapshot/criu) with `built-for`,
# the note of which criu was installed (version, patched or stock and why, its source),
# that `jupyter gpu-snapshot check` and the server's status read; the stand-in
# (jupyter_gpu_snapshot/gpu/cuda_checkpoint_shim.c) goes to $JGS_LIBDIR/bin.
#
# Settings (environment):
#   CRIU_SOURCE_TARBALL  build from this criu source tarball instead of fetching one
#   CRIU_PATCHES_DIR     the series to apply, in name order (default scripts/criu-patches)
#   CRIU_STOCK=1         build stock criu, patches untried (the tests' second criu)
#   CRIU_CACHE_DIR       where fetched sources and build trees are kept (default
#                        /var/cache/jupyter-gpu-snapshot/criu); a tree is reused only for
#                        the same source and the same patches, so it is the same build
# apt's own sources and lists are left untouched: the source packages are looked up in
# lists of the cache's own.
set -euo pipefail

MIN_VERSION=4.2
BASE_VERSION=4.2.1
BASE_TARBALL=criu_4.2.1.orig.tar.xz
BASE_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
SUITES="sid testing"

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${CRIU_PREFIX:-/usr/local}
LIBDIR=${JGS_LIBDIR:-$PREFIX/lib/jupyter-gpu-snapshot}
CACHE=${CRIU_CACHE_DIR:-/var/cache/jupyter-gpu-snapshot/criu}
SHIM_SRC=$HERE/../jupyter_gpu_snapshot/gpu/cuda_checkpoint_shim.c
PATCHES=${CRIU_PATCHES_DIR:-$HERE/criu-patches}
PATCHES_SUM=$(cat "$PATCHES"/*.patch | sha256sum | cut -c1-16)
if [ -n "${CRIU_STOCK:-}" ]; then WANT=stock; else WANT="patches $PATCHES_SUM"; fi

log() { echo "install-criu: $*" >&2; }

version_ok() {
    local v
    v=$("$1" --version 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$v" ] || return 1
    [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$v" | sort -V | head -1)" = "$MIN_VERSION" ]
}

sha256() { sha256sum "$1" | cut -d' ' -f1; }

# The stand-in needs only a C compiler; it is rebuilt whenever its source or its flags
# change. Static: a node agent runs it inside a user's container (agent/pods/entry.py),
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

# A note field ("fill: parallel" gives "parallel") of the installed criu's built-for.
note_field() {
    sed -n "s/^$1: //p" "$LIBDIR/criu/built-for" 2>/dev/null | head -1
}

# Whether the criu at $1 is the one the note describes, built as wanted now: the same
# binary, with our patches of today (or stock when stock is wanted) and, with a source
# given, from that source. A stock criu installed because the patches did not fit is
# tried again: the cached trees make that a self-check, or less.
installed_as_wanted() {
    [ -f "$LIBDIR/criu/cuda_plugin.so" ] || return 1
    [ "$(note_field criu-sha256)" = "$(sha256 "$1")" ] || return 1
    [ "$(note_field wanted)" = "$WANT" ] || return 1
    [ "$WANT" = stock ] || [ "$(note_field fill)" = parallel ] || return 1
    if [ -n "${CRIU_SOURCE_TARBALL:-}" ]; then
        [ "$(note_field source | awk '{print $3}')" = "$(sha256 "$CRIU_SOURCE_TARBALL")" ] || return 1
    fi
}

# The cache's own apt lists of Debian's source packages, from the mirror this machine
# already uses (no registry host is written into the project).
APT_OPTS=()
apt_lists() {
    local mirror
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    if [ -z "$mirror" ]; then
        mirror=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)
    fi
    if [ -z "$mirror" ]; then
        log "cannot find a Debian mirror in apt's sources; set CRIU_SOURCE_TARBALL to a criu source tarball"
        exit 1
    fi
    mkdir -p "$CACHE/apt/lists/partial" "$CACHE/apt/cache/archives/partial"
    cat > "$CACHE/apt/criu-src.sources" <<SRC
Types: deb-src
URIs: $mirror
Suites: $SUITES
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    APT_OPTS=(-o "Dir::Etc::SourceList=$CACHE/apt/criu-src.sources"
              -o "Dir::Etc::SourceParts=$CACHE/apt/none"
              -o "Dir::State::Lists=$CACHE/apt/lists" -o "Dir::Cache=$CACHE/apt/cache")
    apt-get "${APT_OPTS[@]}" update -qq
}

# The path of a criu source tarball: the one given, else the base from the cache, else
# the base from Debian's suites, else the newest criu they have.
fetch_source() {
    local versions pick dir
    if [ -n "${CRIU_SOURCE_TARBALL:-}" ]; then
        echo "$CRIU_SOURCE_TARBALL"
        return
    fi
    mkdir -p "$CACHE/sources"
    if [ -f "$CACHE/sources/$BASE_TARBALL" ] && \
        [ "$(sha256 "$CACHE/sources/$BASE_TARBALL")" = "$BASE_SHA256" ]; then
        echo "$CACHE/sources/$BASE_TARBALL"
        return
    fi
    log "fetching criu's source package (suites: $SUITES)"
    apt_lists >&2
    # Debian versions of the source package, newest first: "4.2.1-1".
    versions=$(apt-cache "${APT_OPTS[@]}" showsrc criu 2>/dev/null | awk '/^Version:/ {print $2}' | sort -rV)
    pick=$(echo "$versions" | grep -E "^([0-9]+:)?${BASE_VERSION//./\\.}-" | head -1 || true)
    if [ -z "$pick" ]; then
        pick=$(echo "$versions" | head -1)
        [ -n "$pick" ] || { log "no suite of $SUITES has a criu source package"; exit 1; }
        log "no suite has criu $BASE_VERSION (the patches' base) any more; taking $pick"
    fi
    dir=$(mktemp -d "$CACHE/sources/fetch.XXXXXX")
    # The .debian.tar.xz part may be missing on the mirror; the upstream tarball is enough.
    (cd "$dir" && apt-get "${APT_OPTS[@]}" source --download-only -qq "criu=$pick" >/dev/null 2>&1) || true
    local orig
    orig=$(ls "$dir"/criu_*.orig.tar.* 2>/dev/null | head -1 || true)
    if [ -z "$orig" ]; then
        rm -rf "$dir"
        log "could not download criu $pick's source package"
        exit 1
    fi
    mv "$orig" "$CACHE/sources/"
    rm -rf "$dir"
    echo "$CACHE/sources/$(basename "$orig")"
}

# Builds criu and its CUDA plugin in the cache's tree for source $1 (with the patches
# unless $2 is "stock"); prints the tree. A tree whose build completed is the same build,
# and one whose patches or build failed the same failure: both are reused. Fails with the
# reason in $work/why.
build_tree() {
    local tarball=$1 mode=$2 key tree p
    key=$(sha256 "$tarball" | cut -c1-16)-$([ "$mode" = stock ] && echo stock || echo "patched-$PATCHES_SUM")
    tree=$CACHE/build/$key
    if [ -f "$tree/.built" ]; then
        echo "$tree"
        return 0
    fi
    if [ -f "$tree.failed" ]; then
        cp "$tree.failed" "$work/why"
        return 1
    fi
    rm -rf "$tree"
    mkdir -p "$tree"
    tar -C "$tree" --strip-components=1 -xf "$tarball"
    if [ "$mode" != stock ]; then
        for p in "$PATCHES"/*.patch; do
            if ! patch -s -p1 -N --fuzz=0 --no-backup-if-mismatch -d "$tree" < "$p" >"$work/patch.log" 2>&1; then
                echo "$(basename "$p") does not apply: $(grep -m1 -iE 'fail|reject|malformed' "$work/patch.log" || tail -1 "$work/patch.log")" > "$work/why"
                cp "$work/why" "$tree.failed"
                rm -rf "$tree"
                return 1
            fi
        done
    fi
    log "building criu ($mode) in $tree"
    if ! make -C "$tree" -j"$(nproc)" criu cuda_plugin >"$tree/build.log" 2>&1; then
        echo "the build failed: $(grep -m1 -E 'error|Error' "$tree/build.log" || tail -1 "$tree/build.log")" > "$work/why"
        tail -30 "$tree/build.log" >&2
        # A stock build that fails may be this machine's (a missing package): tried again.
        [ "$mode" = stock ] || cp "$work/why" "$tree.failed"
        return 1
    fi
    # What the tree is, for scripts/criu-zdtm.py: "stock" or "patches SUM".
    if [ "$mode" = stock ]; then echo stock; else echo "patches $PATCHES_SUM"; fi > "$tree/.mode"
    echo "$(basename "$tarball") sha256 $(sha256 "$tarball")" > "$tree/.source"
    touch "$tree/.built"
    echo "$tree"
}

tree_version() {
    awk -F':= *' '/^CRIU_VERSION_(MAJOR|MINOR|SUBLEVEL)/ {printf "%s%s", sep, $2; sep="."}' \
        "$1/Makefile.versions"
}

if [ "${1:-}" = source ]; then
    src=$(fetch_source)
    [ "$(sha256 "$src")" = "$BASE_SHA256" ] || { log "$src is not criu $BASE_VERSION's source (sha256)"; exit 1; }
    echo "$src"
    exit 0
fi

# The criu a rerun would keep: the prefix's when one is named, else the one on PATH.
if [ -n "${CRIU_PREFIX:-}" ]; then existing=$PREFIX/sbin/criu; else existing=$(command -v criu || true); fi
if [ -n "$existing" ] && [ -x "$existing" ] && version_ok "$existing"; then
    if "$existing" check >/dev/null 2>&1 && installed_as_wanted "$existing"; then
        install_shim
        log "using $existing ($("$existing" --version | head -1), $(note_field fill) fill) and its CUDA plugin"
        exit 0
    fi
    log "$existing is not the criu this install builds; building it"
fi

if [ "$(id -u)" != 0 ]; then
    log "building CRIU needs root (apt-get and install to $PREFIX); rerun as root"
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# criu's build, its zdtm (python3-yaml, python3-protobuf) and zdtm's network namespaces
# (iptables), for scripts/criu-zdtm.py.
DEPS="build-essential pkg-config patch xz-utils libprotobuf-dev libprotobuf-c-dev
    protobuf-c-compiler protobuf-compiler python3-protobuf python3-yaml libnl-3-dev
    libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev libaio-dev uuid-dev
    iproute2 util-linux iptables"
missing=""
for p in $DEPS; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
    log "installing build dependencies:$missing"
    apt-get update -qq
    # shellcheck disable=SC2086 # the packages are words
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

mkdir -p "$CACHE"
# One install at a time builds in the cache.
exec 9>"$CACHE/.lock"
flock 9
work=$(mktemp -d /tmp/criu-install.XXXXXX)
trap 'rm -rf "$work"' EXIT

tarball=$(fetch_source)
tarball_sha=$(sha256 "$tarball")
if [ "$tarball_sha" = "$BASE_SHA256" ]; then
    base="yes"
else
    base="no, the patches' base is $BASE_VERSION ($BASE_TARBALL sha256 $BASE_SHA256)"
fi
log "source $(basename "$tarball") (sha256 $tarball_sha)"

fill=""
if [ "$WANT" = stock ]; then
    why="stock criu was asked for (CRIU_STOCK)"
elif tree=$(build_tree "$tarball" patched); then
    log "self-check of the patched criu $(tree_version "$tree")"
    if bash "$HERE/criu-fill-check.sh" "$tree/criu/criu" 1>&2 2>"$work/why"; then
        fill=parallel
    else
        why="the self-check failed: $(grep '^criu-fill-check: ' "$work/why" | tail -1 | sed 's/^criu-fill-check: //')"
    fi
else
    why=$(cat "$work/why")
fi
if [ -z "$fill" ]; then
    if [ "$WANT" != stock ]; then
        log "our patches do not fit this criu ($why); installing stock criu: it works, its restores are slower"
    fi
    if ! tree=$(build_tree "$tarball" stock); then
        # Stock criu does not build either: this machine's fault, not the patches'; the
        # patched build is tried again next time.
        rm -f "$CACHE/build/$(echo "$tarball_sha" | cut -c1-16)-patched-$PATCHES_SUM.failed"
        log "$(cat "$work/why")"
        exit 1
    fi
    fill="one thread"
fi

install -D -m 0755 "$tree/criu/criu" "$PREFIX/sbin/criu"
hash -r
log "installed $PREFIX/sbin/criu ($("$PREFIX/sbin/criu" --version | head -1), $fill fill)"
# criu loads every .so of its plugin directory: this one holds the CUDA plugin alone.
install -D -m 0644 "$tree/plugins/cuda/cuda_plugin.so" "$LIBDIR/criu/cuda_plugin.so"
# What the product reads of this criu (core/criu_build.py): first line, the version line
# of the criu the plugin was built with and its patches ("stock" for none).
{
    if [ "$fill" = parallel ]; then
        echo "$("$PREFIX/sbin/criu" --version | head -1) patches $PATCHES_SUM"
    else
        echo "$("$PREFIX/sbin/criu" --version | head -1) stock"
    fi
    echo "fill: $fill"
    [ "$fill" = parallel ] || echo "why: $why"
    echo "source: $(basename "$tarball") sha256 $tarball_sha"
    echo "base: $base"
    echo "wanted: $WANT"
    echo "criu-sha256: $(sha256 "$PREFIX/sbin/criu")"
    echo "tree: $tree"
} > "$LIBDIR/criu/built-for.tmp"
mv "$LIBDIR/criu/built-for.tmp" "$LIBDIR/criu/built-for"
log "installed $LIBDIR/criu/cuda_plugin.so"
install_shim
if ! "$PREFIX/sbin/criu" check >/dev/null 2>&1; then
    log "warning: 'criu check' reports problems on this machine:"
    "$PREFIX/sbin/criu" check >&2 || true
fi
