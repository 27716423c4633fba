#!/bin/sh
# End-to-end test of the harness's one command, bench/run.sh, with real fio
# and a real cairn binary on a tiny state (the PyTorch peer and cairn's
# Python API left out: CI has no torch). It checks what --repeat 2 must
# give: every fio write and direct-read job run twice (fio-JOB.json and
# fio-JOB.2.json) and reported as the median of its two samples, the
# page-cached read once, two memcpy samples in cairn's JSON, and a report
# with its targets (the Python API's not measured, with the reason).
#
#   sh bench/test_run.sh CAIRN_BINARY WORK_DIR
set -eu
CAIRN=$1
WORK=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$WORK"
mkdir -p "$WORK"
# What run.sh refuses or fio cannot do here is a skip (CTest: 77), not a
# failure: a RAM filesystem, or one without O_DIRECT.
case $(df --output=fstype "$WORK" | tail -n 1) in
  tmpfs|ramfs) echo "test_run: skipped: $WORK is on a RAM filesystem"; exit 77 ;;
esac
if ! dd if=/dev/zero of="$WORK/probe" bs=4096 count=1 oflag=direct \
    2>/dev/null; then
  echo "test_run: skipped: no O_DIRECT in $WORK"
  exit 77
fi
rm -f "$WORK/probe"
if ! bash "$ROOT/bench/run.sh" --dir "$WORK/dir" --sizes 4MiB --repeat 2 \
    --skip-torch --fio-runtime 1 --out "$WORK/out" --cairn "$CAIRN" \
    > "$WORK/report.md" 2> "$WORK/progress.txt"; then
  cat "$WORK/progress.txt" >&2
  echo "test_run: bench/run.sh failed" >&2
  exit 1
fi
python3 - "$WORK/out" <<'PY'
import json, os, sys
out = sys.argv[1]
errors = []
def check(ok, what):
    if not ok:
        errors.append(what)
report = json.load(open(os.path.join(out, "report.json")))
jobs = {j["job"]: j for j in report["limits"]["jobs"]}
for job in ("write-direct-psync", "write-buffered-psync-fsync",
            "read-direct-psync"):
    check(os.path.exists(os.path.join(out, f"fio-{job}.json")) and
          os.path.exists(os.path.join(out, f"fio-{job}.2.json")),
          f"{job}: two sample files")
    j = jobs.get(job)
    check(j is not None, f"{job}: in the report")
    if j:
        s = j["samples_gb_per_s"]
        check(len(s) == 2 and all(s), f"{job}: two samples, got {s}")
        if len(s) == 2 and all(s):
            check(abs(j["gb_per_s"] - (s[0] + s[1]) / 2) < 1e-9,
                  f"{job}: the median of {s} is not {j['gb_per_s']}")
page = jobs.get("read-pagecache-psync")
check(page is not None and len(page["samples_gb_per_s"]) == 1,
      "read-pagecache-psync: one sample")
check(not os.path.exists(os.path.join(out, "fio-read-pagecache-psync.2.json")),
      "read-pagecache-psync: run once")
cairn = json.load(open(os.path.join(out, "cairn-4MiB.json")))
check(len(cairn["memcpy"]["samples"]) == 2, "cairn: two memcpy samples")
check(len(report["targets"]) == 9, "nine targets for the one size")
sink = [t for t in report["targets"] if t["target"].startswith("streaming")]
check(len(sink) == 1 and sink[0]["result"] == "met",
      "load_sink within its budget: " + str(sink))
# --skip-torch leaves out cairn's Python API too (it runs on
# torch.distributed), with the reason in the report.
check(open(os.path.join(out, "cairn_py.skipped")).read().startswith(
    "--skip-torch given"), "cairn_py.skipped: the reason")
py = [t for t in report["targets"] if t["target"].startswith("cairn Python")]
check(len(py) == 2 and all(t["result"] == "not measured" for t in py),
      "the Python API's targets: not measured")
md = open(os.path.join(out, "report.md")).read()
check("samples GB/s" in md and "median of 2 samples" in md,
      "report.md: the samples and the median")
if errors:
    print("test_run:", *errors, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print(f"test_run: ok ({len(jobs)} fio jobs, "
      f"{len(cairn['results'])} cairn rows)")
PY
rm -rf "$WORK"
