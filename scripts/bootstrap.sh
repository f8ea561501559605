#!/usr/bin/env bash
# Create the project's virtual environment (.venv) if needed and install the project into it
# with its demo and test extras. Re-installs only when pyproject.toml changed.
# Sourced by scripts/test and scripts/demo; needs only python3 (>= 3.11) with venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "error: $PYTHON is $("$PYTHON" --version 2>&1); ray-serve-health needs Python >= 3.11" >&2
  exit 1
}
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment in $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "installing ray-serve-health[test] into $VENV (first run takes a minute or two)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
# tests/deploy renders the kustomize manifests in deploy/ with `kubectl kustomize`. Without a
# kubectl, install Debian's (package kubernetes-client) when we may: as root, with apt-get.
# Failing that, only tests/deploy fails, and says how to install one. (The manifests need
# kubectl >= 1.21; Debian 12's package is 1.20, and tests/deploy says so if that is what it finds.)
if ! command -v kubectl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing kubectl (Debian package kubernetes-client) for tests/deploy" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null; } \
      || echo "warning: could not install kubernetes-client; tests/deploy will fail without kubectl" >&2
  else
    echo "warning: kubectl not found (and not root with apt-get to install it); tests/deploy will fail" >&2
  fi
fi
export PATH="$VENV/bin:$PATH"
