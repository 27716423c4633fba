#!/bin/sh
# Command 2: install dependencies, build cairn, and run the whole test suite:
# the C++ tests (ctest) and the Python package's (pytest, python/tests).
#   scripts/test.sh           the default build (warnings are errors)
#   scripts/test.sh --asan    the C++ tests under AddressSanitizer + UBSan
#                             (the Python tests need an uninstrumented
#                             extension, so they run only in the default)
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
preset=default
if [ "${1:-}" = "--asan" ]; then preset=asan; fi
sh scripts/install-deps.sh
# The object storage tests start a moto server (installed above): there,
# a missing server is a failure, not a skip.
export CAIRN_REQUIRE_S3_SERVER=1
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset"
if [ "$preset" = default ]; then
  echo "test: building and installing the Python package (pip install .)"
  $PYTHON -m pip install -q --disable-pip-version-check --no-build-isolation .
  $PYTHON -m pytest -q python/tests
fi
