#!/usr/bin/env bash
# What building the JupyterLab extension and its browser tests need from Debian:
# Node.js with npm (the extension builds with node and jlpm) and chromium (Playwright
# drives the system browser; no browser is downloaded). Installs only what is missing, so
# a second run does nothing and needs no network.
set -euo pipefail

NODE_MIN_MAJOR=18

log() { echo "install-ui-deps: $*" >&2; }

node_ok() {
    command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || return 1
    local major
    major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    [ "$major" -ge "$NODE_MIN_MAJOR" ]
}

missing=()
if ! node_ok; then
    if command -v node >/dev/null 2>&1 && ! command -v npm >/dev/null 2>&1; then
        missing+=(npm)
    elif command -v node >/dev/null 2>&1; then
        log "node $(node --version) is older than $NODE_MIN_MAJOR; installing Debian's nodejs"
        missing+=(nodejs npm)
    else
        missing+=(nodejs npm)
    fi
fi
if [ ! -x /usr/bin/chromium ]; then
    missing+=(chromium)
fi
# Chromium renders text with these; without them screenshots show empty boxes.
if ! dpkg-query -W -f='${Status}' fonts-liberation 2>/dev/null | grep -q "install ok installed"; then
    missing+=(fonts-liberation)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "please install: ${missing[*]}"
    exit 1
fi
log "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if ! node_ok; then
    log "node >= $NODE_MIN_MAJOR with npm is still missing after the install"
    exit 1
fi
