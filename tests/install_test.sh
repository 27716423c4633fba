#!/bin/sh
# Installs the built cairn into a temporary prefix, builds a separate project
# against it with find_package(cairn), and runs it.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -eu
build="$1"
src="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/cairn-install-XXXXXX")"
trap 'rm -rf "$work"' EXIT
step() {  # step NAME COMMAND...: run, and show its log if it fails
  name="$1"; shift
  if ! "$@" > "$work/$name.log" 2>&1; then
    echo "install_test: $name failed:"; cat "$work/$name.log"; exit 1
  fi
}
step install cmake --install "$build" --prefix "$work/prefix"
step configure cmake -S "$src/tests/install_consumer" -B "$work/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix"
step build cmake --build "$work/build"
"$work/build/consumer" "$work/ckpt"
