#!/usr/bin/env bash
# The benchmark harness of issue 6 in one command: the physical limits of a
# directory (fio), cairn (`cairn bench`, and its Python API through
# bench/peers/cairn_py_peer.py) and PyTorch checkpointing
# (bench/peers/torch_peer.py) on the same tensors, then bench/report.py.
# bench/README.md describes what is measured and how to read the report.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PROG=bench/run.sh

usage() {
  cat <<EOF
Usage: $PROG [--dir DIR] [--sizes "256MiB 1GiB 2GiB"] [--ranks 4] [--repeat N]
                    [--out RESULTS_DIR] [--cairn PATH] [--skip-fio] [--skip-torch]
                    [--skip-cairn-python] [--fio-runtime SECONDS] [--python PATH]

  --dir DIR           directory on the storage to measure (created if missing;
                      must not be tmpfs). Default /var/tmp/cairn-bench
  --sizes "S ..."     state sizes, as cairn takes them. Default "256MiB 1GiB 2GiB"
  --ranks W           ranks that save (loads run on W, W/2 and W-1). Default 4
  --repeat N          samples of every timed phase and of every fio job (the
                      jobs taking turns) and memcpy; medians are reported.
                      Default 1
  --out DIR           results folder (must be new or empty).
                      Default bench/results/<date>-<hostname>
  --cairn PATH        the cairn binary. Default build/tools/cairn
  --skip-fio          do not measure the physical limits (reported as not measured)
  --skip-torch        do not run the PyTorch peer, nor cairn's Python API
                      (which runs on torch.distributed); reported as not measured
  --skip-cairn-python do not run cairn through its Python API
                      (bench/peers/cairn_py_peer.py; reported as not measured)
  --fio-runtime S     time limit of each fio job in seconds. Default 10
  --python PATH       the Python that runs the PyTorch peer and cairn's Python
                      API: it needs torch 2.x (torch.distributed.checkpoint
                      save/load/async_save, DTensor) and the cairn package.
                      Default: python3 on PATH, which must have torch 2.x;
                      name another to measure another torch (say Debian's
                      /usr/bin/python3 with torch 1.13)

Writes fio-*.json, cairn-SIZE.json, model-SIZE.json, torch-SIZE.json,
cairn_py-SIZE.json, run.json, report.md and report.json into the results
folder and prints
report.md. Progress goes to stderr. Cold loads drop the page cache, which
needs root; without it the cold rows are reported as not measured.
EOF
}

say() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }

# step NAME COMMAND...: runs COMMAND; if it fails, stops the run naming NAME.
step() {
  local name=$1
  shift
  say "$name"
  "$@" || die "step '$name' failed (exit status $?); nothing after it ran"
}

# Bytes in a size as cairn parses it: K/M/G/T, KiB.. and plain are powers of
# 1024, KB.. powers of 1000; fractions allowed. Needed for the fio file size
# and the free-space check.
to_bytes() {
  awk -v s="$1" 'BEGIN {
    if (!match(s, /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(s, 1, RLENGTH); u = tolower(substr(s, RLENGTH + 1))
    p = index("kmgt", substr(u, 1, 1)); rest = substr(u, 2)
    if (u == "" || u == "b") m = 1
    else if (p == 0) exit 1
    else if (rest == "" || rest == "i" || rest == "ib") m = 1024 ^ p
    else if (rest == "b") m = 1000 ^ p
    else exit 1
    printf "%.0f\n", n * m
  }'
}

DIR=/var/tmp/cairn-bench
SIZES="256MiB 1GiB 2GiB"
RANKS=4
REPEAT=1
OUT=
CAIRN=$ROOT/build/tools/cairn
SKIP_FIO=0
SKIP_TORCH=0
SKIP_CAIRN_PY=0
FIO_RUNTIME=10
PEER_PYTHON=
COMMAND_LINE="$PROG$(printf " %q" "$@")"

while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --skip-fio) SKIP_FIO=1; shift; continue ;;
    --skip-torch) SKIP_TORCH=1; shift; continue ;;
    --skip-cairn-python) SKIP_CAIRN_PY=1; shift; continue ;;
    --dir|--sizes|--ranks|--repeat|--out|--cairn|--fio-runtime|--python)
      [ $# -ge 2 ] || die "$1 needs a value (see --help)" ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  case $1 in
    --dir) DIR=$2 ;;
    --sizes) SIZES=$2 ;;
    --ranks) RANKS=$2 ;;
    --repeat) REPEAT=$2 ;;
    --out) OUT=$2 ;;
    --cairn) CAIRN=$2 ;;
    --fio-runtime) FIO_RUNTIME=$2 ;;
    --python) PEER_PYTHON=$2 ;;
  esac
  shift 2
done

# ---- arguments and prerequisites, all checked before anything is measured
for n in "$RANKS" "$REPEAT" "$FIO_RUNTIME"; do
  case $n in ''|*[!0-9]*|0) die "--ranks, --repeat and --fio-runtime take a positive integer, not '$n'" ;; esac
done
[ -n "${SIZES// /}" ] || die "--sizes is empty"
LARGEST=0
for s in $SIZES; do
  # The size is also part of file names, so only what cairn accepts.
  b=$(to_bytes "$s") || die "bad size '$s' in --sizes: expected e.g. 4096, 500M, 256MiB, 2GiB or 1.5GB"
  [ "$b" -gt 0 ] || die "bad size '$s' in --sizes: must be positive"
  if [ "$b" -gt "$LARGEST" ]; then LARGEST=$b; fi
done

[ -x "$CAIRN" ] || die "no cairn binary at $CAIRN: build it first
  (cmake --preset default && cmake --build --preset default --target cairn_cli)
  or pass --cairn PATH"
command -v python3 >/dev/null || die "python3 not found (needed for bench/report.py)"
if [ "$SKIP_FIO" = 0 ]; then
  command -v fio >/dev/null || die "fio not found: apt-get install -y fio (or --skip-fio)"
fi
# cairn's Python API runs its ranks over torch.distributed: no torch, no rows.
if [ "$SKIP_TORCH" = 1 ]; then SKIP_CAIRN_PY=1; fi
if [ "$SKIP_TORCH" = 0 ] || [ "$SKIP_CAIRN_PY" = 0 ]; then
  # The peer to beat is torch 2.x's torch.distributed.checkpoint (save,
  # load, async_save). Unless --python names an interpreter, python3 on
  # PATH, and it must have torch 2.x: Debian's /usr/bin/python3 has torch
  # 1.13, which has neither dcp.save nor async_save and is measured only
  # when asked for by name.
  if [ -z "$PEER_PYTHON" ]; then
    PEER_PYTHON=$(command -v python3) ||
      die "python3 not found on PATH: pass --python PATH (a Python with torch 2.x and cairn), or --skip-torch"
    PEER_DEFAULT=1
  fi
  [ -x "$PEER_PYTHON" ] || die "$PEER_PYTHON not found (pass --python PATH, or --skip-torch)"
  TORCH_VERSION=$("$PEER_PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
    die "$PEER_PYTHON cannot import torch: pip install torch==2.13.0, or --python PATH, or --skip-torch"
  case $TORCH_VERSION in
    0.*|1.*)
      if [ "${PEER_DEFAULT:-0}" = 1 ]; then
        die "$PEER_PYTHON (python3 on PATH) has torch $TORCH_VERSION; the peer is torch 2.x: pass --python PATH with torch 2.x (or name this one with --python to measure torch $TORCH_VERSION anyway)"
      fi
      # torch 1.13 has no DTensor: cairn's Python rows need 2.x.
      if [ "$SKIP_CAIRN_PY" = 0 ]; then
        CAIRN_PY_SKIPPED="$PEER_PYTHON has torch $TORCH_VERSION; cairn's Python rows need torch 2.x (DTensor)"
        SKIP_CAIRN_PY=1
      fi ;;
  esac
  if [ "$SKIP_CAIRN_PY" = 0 ]; then
    CAIRN_PY_VERSION=$("$PEER_PYTHON" -c 'import cairn; print(cairn.__version__)' 2>/dev/null) ||
      die "$PEER_PYTHON cannot import cairn: pip install --no-build-isolation . (or --python PATH, or --skip-cairn-python)"
  fi
fi

# Filesystem and free space of DIR, or of the folder it will be made in:
# nothing is created before every check has passed.
at=$DIR
while [ ! -e "$at" ]; do at=$(dirname "$at"); done
FSTYPE=$(df --output=fstype "$at" | tail -n 1)
# fio's direct jobs need O_DIRECT, and a RAM filesystem has no disk to measure.
case $FSTYPE in
  tmpfs|ramfs) die "--dir $DIR is on $FSTYPE: choose a directory on the disk to measure" ;;
esac

# The fio file is the largest state size, kept within [256 MiB, 2 GiB]:
# smaller files give too short a run to time, larger ones only add layout
# time; sequential throughput is reached well within 2 GiB.
FIO_BYTES=$LARGEST
if [ "$FIO_BYTES" -lt $((256 << 20)) ]; then FIO_BYTES=$((256 << 20)); fi
if [ "$FIO_BYTES" -gt $((2 << 30)) ]; then FIO_BYTES=$((2 << 30)); fi
# Peak use, one step at a time (each removes its files): the fio file;
# cairn's sync checkpoint and up to two async ones; the peer's two DCP
# checkpoints.
NEED=$((3 * LARGEST))
if [ "$NEED" -lt "$FIO_BYTES" ]; then NEED=$FIO_BYTES; fi
AVAIL=$(df -B1 --output=avail "$at" | tail -n 1 | tr -d ' ')
[ "$AVAIL" -ge "$NEED" ] ||
  die "$DIR has $((AVAIL >> 20)) MiB free; this run needs about $((NEED >> 20)) MiB (3 x the largest size)"

if [ -z "$OUT" ]; then
  OUT=$ROOT/bench/results/$(date +%F)-$(hostname -s)
  # A second run on the same day gets its own folder rather than mixing in.
  base=$OUT
  i=2
  while [ -e "$OUT" ]; do OUT=$base-$i; i=$((i + 1)); done
elif [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  die "--out $OUT is not empty: its old files would mix into this report; choose a new folder"
fi
mkdir -p "$DIR" || die "cannot create --dir $DIR"
DIR=$(cd "$DIR" && pwd)
mkdir -p "$OUT" || die "cannot create --out $OUT"
OUT=$(cd "$OUT" && pwd)

FIO_FILE=$DIR/cairn-bench-fio.$$
cleanup() { rm -f "$FIO_FILE" "$FIO_FILE.probe"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

say "results in $OUT; measuring $DIR ($FSTYPE); sizes: $SIZES; ranks $RANKS; repeat $REPEAT"

python3 -c 'import json, sys
a = sys.argv[2:]
json.dump(dict(zip(a[::2], a[1::2])), open(sys.argv[1], "w"), indent=1)' \
  "$OUT/run.json" \
  date "$(date -Iseconds)" host "$(hostname)" kernel "$(uname -sr)" \
  cpus "$(nproc)" memory_kib "$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)" \
  dir "$DIR" filesystem "$FSTYPE" \
  device "$(df --output=source "$DIR" | tail -n 1)" \
  sizes "$SIZES" ranks "$RANKS" repeat "$REPEAT" \
  cairn "$CAIRN" cairn_version "$("$CAIRN" --version 2>&1 | head -n 1)" \
  fio_version "$(if [ "$SKIP_FIO" = 0 ]; then fio --version | sed 's/^fio-//'; else echo skipped; fi)" \
  fio_file_bytes "$FIO_BYTES" fio_runtime_s "$FIO_RUNTIME" \
  torch_version "${TORCH_VERSION:-skipped}" python "${PEER_PYTHON:-skipped}" \
  cairn_python_version "${CAIRN_PY_VERSION:-skipped}" command "$COMMAND_LINE"

# ---- (a) physical limits: sequential 1 MiB I/O on one file in DIR
# fio_job NAME OPTIONS...: one job on the test file, its JSON in
# fio-NAME.json (the first sample) or fio-NAME.K.json (the K-th, K = $REP).
# Size-bound with a time limit: it stops after the file or FIO_RUNTIME.
# REP=once: a job run once whatever --repeat says.
fio_job() {
  local name=$1 file=fio-$1.json label="fio $1"
  shift
  if [ "$REP" != once ] && [ "$REPEAT" -gt 1 ]; then
    label="$label (sample $REP of $REPEAT)"
    if [ "$REP" -gt 1 ]; then file=fio-$name.$REP.json; fi
  fi
  sync  # earlier dirty data must not be flushed inside this job's time
  step "$label" fio --name="$name" \
    --filename="$FIO_FILE" --size="$FIO_BYTES" --bs=1M \
    --runtime="$FIO_RUNTIME" --output-format=json --output="$OUT/$file" "$@"
}

# An engine the kernel or this fio lacks (io_uring is often disabled in
# containers) is skipped, its reason left in fio-JOB.skipped for the report,
# rather than failing the run.
engine_ok() {
  local err job
  err=$(fio --name=probe --filename="$FIO_FILE.probe" --size=4M --bs=1M \
          --rw=read --direct=1 --ioengine="$1" --iodepth=16 \
          --output=/dev/null 2>&1) && return 0
  err=$(printf '%s' "$err" | tr '\n' ' ' | cut -c1-300)
  for job in write-direct-$1-qd16 read-direct-$1-qd16; do
    printf 'fio engine %s unavailable here: %s\n' "$1" "$err" > "$OUT/fio-$job.skipped"
  done
  say "fio engine $1 unavailable; its jobs are skipped"
  return 1
}

if [ "$SKIP_FIO" = 1 ]; then
  echo "--skip-fio given" > "$OUT/fio.skipped"
  say "fio skipped (--skip-fio)"
else
  say "fio: $((FIO_BYTES >> 20)) MiB file $FIO_FILE, at most $FIO_RUNTIME s a job"
  ENGINES=psync
  for eng in libaio io_uring; do
    if engine_ok "$eng"; then ENGINES="$ENGINES $eng"; fi
  done
  # --repeat N runs every job N times, the jobs taking turns, so that
  # each limit is a median over the same minutes as the others (report.py
  # takes it), as cairn's and the peer's rows are medians of their samples.
  for REP in $(seq "$REPEAT"); do
    # Each write job starts from a fresh file, as a checkpoint does.
    for eng in $ENGINES; do
      if [ "$eng" = psync ]; then name=write-direct-psync depth=1
      else name=write-direct-$eng-qd16 depth=16
      fi
      rm -f "$FIO_FILE"
      fio_job "$name" --rw=write --direct=1 --ioengine="$eng" --iodepth="$depth"
    done
    # Buffered writes count only with the final fsync: without it fio
    # measures the page cache, not the disk.
    rm -f "$FIO_FILE"
    fio_job write-buffered-psync-fsync --rw=write --direct=0 --ioengine=psync --end_fsync=1
    for eng in $ENGINES; do
      if [ "$eng" = psync ]; then name=read-direct-psync depth=1
      else name=read-direct-$eng-qd16 depth=16
      fi
      fio_job "$name" --rw=read --direct=1 --ioengine="$eng" --iodepth="$depth"
    done
  done
  REP=once
  # Page-cached: the file is read once, untimed, so the job reads it from
  # memory; --invalidate=0 stops fio from dropping it from the cache first.
  step "fio read-pagecache-psync (prefill)" cat "$FIO_FILE" > /dev/null
  fio_job read-pagecache-psync --rw=read --direct=0 --ioengine=psync --invalidate=0
  cleanup
fi

# ---- (b) cairn, cairn's Python API and the PyTorch peer, per size, on the
# same tensors
if [ "$SKIP_TORCH" = 1 ]; then echo "--skip-torch given" > "$OUT/torch.skipped"; fi
if [ "$SKIP_CAIRN_PY" = 1 ]; then
  if [ "$SKIP_TORCH" = 1 ]; then why="--skip-torch given (it runs on torch.distributed)"
  else why=${CAIRN_PY_SKIPPED:-"--skip-cairn-python given"}
  fi
  echo "$why" > "$OUT/cairn_py.skipped"
fi
for s in $SIZES; do
  step "cairn bench $s" "$CAIRN" bench --dir "$DIR" --size "$s" \
    --ranks "$RANKS" --repeat "$REPEAT" --json \
    --model-out "$OUT/model-$s.json" > "$OUT/cairn-$s.json"
  if [ "$SKIP_TORCH" = 0 ]; then
    # The peer's table goes to stderr with the progress; its JSON to --out.
    step "torch peer $s" "$PEER_PYTHON" "$ROOT/bench/peers/torch_peer.py" \
      --model "$OUT/model-$s.json" --dir "$DIR" --ranks "$RANKS" \
      --repeat "$REPEAT" --out "$OUT/torch-$s.json" >&2
  fi
  if [ "$SKIP_CAIRN_PY" = 0 ]; then
    # cairn.save/AsyncSaver/load, and DCP with cairn's storage plugin
    # (cairn.torch) where the package has it; its JSON says when not.
    step "cairn python $s" "$PEER_PYTHON" "$ROOT/bench/peers/cairn_py_peer.py" \
      --model "$OUT/model-$s.json" --dir "$DIR" --ranks "$RANKS" \
      --repeat "$REPEAT" --out "$OUT/cairn_py-$s.json" >&2
  fi
done

# ---- (c) the report: report.md and report.json in OUT, markdown on stdout
step "report" python3 "$ROOT/bench/report.py" "$OUT"
say "done: $OUT/report.md, $OUT/report.json"
