#!/bin/sh
# Command 1: install dependencies, build cairn, and run `cairn demo`.
# Extra arguments go to the demo, e.g. scripts/demo.sh --size 1GiB
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
cmake --preset default
cmake --build --preset default
./build/tools/cairn demo "$@"
