#!/usr/bin/env bash
# What the JupyterHub tests (tests/hub/) need outside the venv: configurable-http-proxy, the
# node proxy that JupyterHub starts in front of the users' servers. JupyterHub itself is a
# Python package in the test extra; the proxy is only published on npm. npm comes from
# install-ui-deps.sh, which runs before this. Installs only when the proxy is missing, so a
# second run does nothing and needs no network.
set -euo pipefail

# JupyterHub 5 and later speak the proxy API of this major.
CHP_VERSION=5

log() { echo "install-hub-deps: $*" >&2; }

command -v configurable-http-proxy >/dev/null 2>&1 && exit 0

if ! command -v npm >/dev/null 2>&1; then
    log "npm is missing (scripts/install-ui-deps.sh installs it); then install:"
    log "  npm install -g configurable-http-proxy@$CHP_VERSION"
    exit 1
fi
# Global, so that the hub finds it on PATH whoever runs the tests (the hub runs as root).
if [ "$(id -u)" != 0 ] && [ ! -w "$(npm root -g)" ]; then
    log "please install: npm install -g configurable-http-proxy@$CHP_VERSION"
    exit 1
fi
log "installing configurable-http-proxy@$CHP_VERSION"
npm install -g --no-fund --no-audit --loglevel=error "configurable-http-proxy@$CHP_VERSION" >/dev/null
if ! command -v configurable-http-proxy >/dev/null 2>&1; then
    log "configurable-http-proxy is not on PATH after the install (npm prefix: $(npm prefix -g))"
    exit 1
fi
