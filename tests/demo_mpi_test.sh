#!/bin/sh
# `cairn demo --comm mpi` under mpiexec, one rank per process:
#   1. 4 ranks save, the first 3 load (one run, resharding), JSON verified;
#   2. 4 ranks save in one run, 2 ranks load in another on the same --dir;
#   3. a --ranks that is not the world size fails on every process;
#   4. --replicas 2: 2 replica groups x 2 ranks save and load (broadcast
#      load: storage serves about one copy of the state, not two);
#   5. --rank-local: 4 ranks save rank-local and load rank-local, then
#      4 save rank-local and 3 load (merge, then reshard);
#   6. a world size that is not a multiple of --replicas fails once.
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

# json_number KEY OUTPUT: the integer value of "KEY" in OUTPUT's JSON object.
json_number() {
  printf '%s\n' "$2" | sed -n "s/.*[{,]\"$1\":\([0-9]*\).*/\1/p"
}

# 4. Data-parallel replicas with broadcast load.
out=$("$mpiexec" "$np" 4 "$cairn" demo --comm mpi --replicas 2 --size 8MiB \
  --json -q --dir "$dir/replicas") ||
  fail "mpiexec -n 4 demo --replicas 2 failed"
expect_json "replicas 2" "$out" '"verified":true' '"replicas":2' '"ranks":2' \
  '"load_ranks":2' '"save_world":4' '"load_world":4' \
  '"load_replica_group_size":2' '"rng_objects_verified":4' '"mismatch":null'
bytes=$(json_number bytes "$out")
nread=$(json_number load_bytes_read "$out")
[ -n "$bytes" ] && [ -n "$nread" ] && [ "$nread" -gt 0 ] ||
  fail "replicas 2: no bytes or load_bytes_read in: $out"
# One copy (a resharding load reads ~1.15x of it), not two.
[ $((nread * 4)) -le $((bytes * 5)) ] ||
  fail "replicas 2: read $nread storage bytes for $bytes bytes of state"

# 5. Rank-local: the same ranks load rank-local; 3 ranks merge first.
out=$("$mpiexec" "$np" 4 "$cairn" demo --comm mpi --rank-local --size 8MiB \
  --json -q --dir "$dir/local") ||
  fail "mpiexec -n 4 demo --rank-local failed"
expect_json "rank-local 4 -> 4" "$out" '"verified":true' '"rank_local":true' \
  '"load_mode":"rank_local"' '"merge_seconds":null' '"save_files":4'
[ -f "$dir/local/rank-00003/metadata.json" ] ||
  fail "rank-local: no rank-00003/metadata.json"
[ ! -e "$dir/local/metadata.json" ] ||
  fail "rank-local 4 -> 4 wrote a global metadata.json"
out=$("$mpiexec" "$np" 4 "$cairn" demo --comm mpi --rank-local --size 8MiB \
  --load-ranks 3 --json -q --dir "$dir/merged") ||
  fail "mpiexec -n 4 demo --rank-local --load-ranks 3 failed"
expect_json "rank-local 4 -> 3" "$out" '"verified":true' '"load_ranks":3' \
  '"load_mode":"merge_then_global"' '"rng_objects_verified":4'
[ -f "$dir/merged/metadata.json" ] || fail "rank-local 4 -> 3 did not merge"

# 5b. --async: an AsyncSaver on the MPI communicator; the load checks the
# last async save.
out=$("$mpiexec" "$np" 2 "$cairn" demo --comm mpi --async --steps 4 \
  --save-every 2 --size 4MiB --load-ranks 2 --json -q --dir "$dir/async") ||
  fail "mpiexec -n 2 demo --async failed"
expect_json "async" "$out" '"verified":true' '"async_steps":4' \
  '"async_save_steps":[2,4]' '"step":1004'
[ -f "$dir/async/step-4/metadata.json" ] || fail "--async wrote no step-4"

# 6. --replicas that does not divide the world size.
if err=$("$mpiexec" "$np" 3 "$cairn" demo --comm mpi --replicas 2 \
  --size 1MiB -q 2>&1); then
  fail "--replicas 2 under mpiexec -n 3 succeeded: $err"
fi
[ "$(printf '%s\n' "$err" | grep -c 'is not a multiple of --replicas 2')" \
  -eq 1 ] || fail "--replicas 2 under mpiexec -n 3: unexpected output: $err"

echo "PASS"
