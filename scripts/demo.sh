#!/bin/sh
# Command 1: install dependencies, build cairn (the C++ library and tool,
# and the Python package), and run `cairn demo`.
# Extra arguments go to the demo, e.g. scripts/demo.sh --size 1GiB
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
sh scripts/install-deps.sh
cmake --preset default
cmake --build --preset default
echo "demo: building and installing the Python package (pip install .)"
$PYTHON -m pip install -q --disable-pip-version-check --no-build-isolation .
(cd / && $PYTHON -c "import cairn; print('demo: python -c \"import cairn\": cairn', cairn.__version__)")
./build/tools/cairn demo "$@"
