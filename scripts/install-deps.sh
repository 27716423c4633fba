#!/bin/sh
# Installs cairn's build and test dependencies: Debian 12 packages for C++
# (apt-get), then the Python side, pinned (python/requirements.txt: pip,
# into the Python first on PATH; torch is the local CPU wheel of 2.13.0).
# Run as root (or with sudo). Safe to run again: both skip what is there.
# librocksdb-dev is the RocksDB key-value table's (src/kv); libssl-dev
# and libcurl4-openssl-dev sign and send object storage requests
# (src/storage/s3); libzstd-dev compresses chunks (src/format/frame_codec).
# fio is the
# benchmark harness's (bench/run.sh), whose end-to-end test
# (bench_run_test) runs with the suite. Set CAIRN_SKIP_PYTHON=1 to install
# only the C++ dependencies.
set -eu
export DEBIAN_FRONTEND=noninteractive
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PKGS="build-essential cmake ninja-build pkg-config \
  libabsl-dev nlohmann-json3-dev libisal-dev libcli11-dev \
  libopenmpi-dev openmpi-bin liburing-dev libdlpack-dev \
  libgtest-dev libgmock-dev libbenchmark-dev librocksdb-dev libssl-dev \
  libcurl4-openssl-dev libzstd-dev libxxhash-dev \
  fio"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "install-deps: installing:$missing"
  $SUDO apt-get update -q
  # shellcheck disable=SC2086
  $SUDO apt-get install -y -q --no-install-recommends $missing
else
  echo "install-deps: all packages present"
fi
if [ "${CAIRN_SKIP_PYTHON:-0}" != 1 ]; then
  PYTHON="${PYTHON:-python3}"
  echo "install-deps: Python packages for $($PYTHON --version 2>&1) ($(command -v "$PYTHON"))"
  $PYTHON -m pip install -q --disable-pip-version-check -r python/requirements.txt
  $PYTHON -m pip install -q --disable-pip-version-check --no-deps \
    -r python/requirements-nodeps.txt
fi
