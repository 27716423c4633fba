#!/bin/sh
# Installs the built cairn into a temporary prefix, builds a separate project
# against it with find_package(cairn), and runs it.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -eu
build="$1"
src="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/cairn-install-XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$src/tests/install_consumer" -B "$work/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log"
"$work/build/consumer" "$work/ckpt"
