#!/usr/bin/env bash
# The README's test command: installs what the tests need besides Rust (idempotent: each step
# runs only when its tool is missing), then runs the whole workspace's tests. Arguments are
# passed to `cargo test`. CI (.ci/run) calls exactly this after formatting and lint checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# Root runs apt and pip directly; anyone else goes through sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# A real browser for the dashboard test, and iproute2 and openssl (its certificates) for the
# network-namespace deployment test.
if ! command -v chromedriver >/dev/null || ! command -v ip >/dev/null \
    || ! command -v openssl >/dev/null; then
    apt_install chromium chromium-driver iproute2 openssl
fi

# pyarrow for the process-UDF tests (Debian 12 has no python3-pyarrow package).
if ! python3 -c "import pyarrow" 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt_install python3-pip
    fi
    # A user install first; Debian's externally-managed Python refuses it without the flag.
    python3 -m pip install --quiet --user pyarrow 2>/dev/null \
        || python3 -m pip install --quiet --user --break-system-packages pyarrow 2>/dev/null \
        || as_root python3 -m pip install --quiet --break-system-packages pyarrow
fi

cargo test --workspace "$@"

# The Python client (python/), installed with pip as a user installs it (maturin, from PyPI,
# builds the native module; `--profile dev` reuses what the tests above compiled), then its
# pytest suite against local clusters of the `floe` binary those tests built.
pip_install() {
    python3 -m pip install --quiet --user "$@" 2>/dev/null \
        || python3 -m pip install --quiet --user --break-system-packages "$@" 2>/dev/null \
        || as_root python3 -m pip install --quiet --break-system-packages "$@"
}
MATURIN_PEP517_ARGS="--profile dev" pip_install './python[test]'
python3 -m pytest -q python/tests
