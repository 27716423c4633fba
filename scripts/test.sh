#!/bin/sh
# Command 2: install dependencies, build cairn, and run the whole test suite.
#   scripts/test.sh           the default build (warnings are errors)
#   scripts/test.sh --asan    the same tests under AddressSanitizer + UBSan
set -eu
cd "$(dirname "$0")/.."
preset=default
if [ "${1:-}" = "--asan" ]; then preset=asan; fi
sh scripts/install-deps.sh
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset"
