#!/bin/sh
# `cairn demo --comm mpi` under mpiexec, one rank per process:
#   1. 4 ranks save, the first 3 load (one run, resharding), JSON verified;
#   2. 4 ranks save in one run, 2 ranks load in another on the same --dir;
#   3. a --ranks that is not the world size fails on every process.
# Fails if a run fails, does not verify, or more than rank 0 prints.
#
# Usage: demo_mpi_test.sh MPIEXEC NUMPROC_FLAG CAIRN
# Open MPI as root needs OMPI_ALLOW_RUN_AS_ROOT=1,
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 and, on small machines,
# OMPI_MCA_rmaps_base_oversubscribe=1 (CTest sets them).
set -eu

mpiexec=$1
np=$2
cairn=$3

dir=$(mktemp -d "${TMPDIR:-/tmp}/cairn-demo-mpi-test-XXXXXX")
trap 'rm -rf "$dir"' EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# expect_json WHAT OUTPUT KEY_VALUE...: OUTPUT is one line of compact JSON
# (nlohmann's dump: sorted keys, no spaces) holding every "key":value.
expect_json() {
  what=$1
  out=$2
  shift 2
  [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] ||
    fail "$what: expected one JSON line (from rank 0 only), got: $out"
  for kv in "$@"; do
    case "$out" in
      *"$kv"*) ;;
      *) fail "$what: no $kv in: $out" ;;
    esac
  done
}

# 1. Save with 4, load with 3, one run.
out=$("$mpiexec" "$np" 4 "$cairn" demo --comm mpi --size 8MiB --load-ranks 3 \
  --json -q --dir "$dir/all") || fail "mpiexec -n 4 demo (save + load) failed"
expect_json "save 4, load 3" "$out" '"verified":true' '"ranks":4' \
  '"load_ranks":3' '"comm":"mpi"' '"mismatch":null'

# 2. Save with 4 and load with 2 in separate runs.
out=$("$mpiexec" "$np" 4 "$cairn" demo --comm mpi --size 8MiB --phase save \
  --step 7 --json -q --dir "$dir/split") ||
  fail "mpiexec -n 4 demo --phase save failed"
expect_json "save 4" "$out" '"ranks":4' '"save_files":4'
out=$("$mpiexec" "$np" 2 "$cairn" demo --comm mpi --phase load --json -q \
  --dir "$dir/split") || fail "mpiexec -n 2 demo --phase load failed"
expect_json "load 2" "$out" '"verified":true' '"ranks":4' '"load_ranks":2' \
  '"step":7' '"rng_objects_verified":4'

# 3. A usage error is reported once and fails the job.
if err=$("$mpiexec" "$np" 2 "$cairn" demo --comm mpi --ranks 3 --size 1MiB \
  -q 2>&1); then
  fail "--ranks 3 under mpiexec -n 2 succeeded: $err"
fi
case "$err" in
  *"--ranks 3 does not match the MPI world size 2"*) ;;
  *) fail "--ranks 3 under mpiexec -n 2: unexpected output: $err" ;;
esac
[ "$(printf '%s\n' "$err" | grep -c 'does not match')" -eq 1 ] ||
  fail "the usage error was printed by more than rank 0: $err"

echo "PASS"
