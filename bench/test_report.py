#!/usr/bin/env python3
"""Tests of bench/report.py on small synthetic results folders.

The inputs have the shapes the real tools write (fio 3.33's JSON, `cairn
bench --json`, bench/peers/torch_peer.py --out), trimmed to the keys the
report reads plus a few it must ignore. Figures are round so that the
expected ratios are exact. bench/peers/cairn_py_peer.py --out (cairn's
Python API and DCP plugin) too. Standard library only.
"""

import copy
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

GB = 10**9
MIB = 1 << 20
STATE = 2 * GB  # bytes of the synthetic state: 1 s is 2 GB/s


def fio(name, rw, direct, engine, bw, depth=1, end_fsync=False,
        runtime=1000):
    """A fio 3.33 --output-format=json document of one job."""
    opts = {"name": name, "filename": "/var/tmp/x/cairn-bench-fio.1",
            "size": "2147483648", "bs": "1M", "runtime": "10", "rw": rw,
            "direct": "1" if direct else "0", "ioengine": engine,
            "iodepth": str(depth)}
    if end_fsync:
        opts["end_fsync"] = "1"
    idle = {"io_bytes": 0, "bw_bytes": 0, "bw": 0, "iops": 0.0, "runtime": 0}
    busy = {"io_bytes": 2147483648, "bw_bytes": bw, "bw": bw // 1024,
            "iops": bw / MIB, "runtime": runtime}
    return {"fio version": "fio-3.33", "timestamp": 1795394896,
            "jobs": [{"jobname": name, "groupid": 0, "error": 0,
                      "job options": opts,
                      "read": busy if rw == "read" else idle,
                      "write": busy if rw == "write" else idle,
                      "job_runtime": 1000}],
            "disk_util": [{"name": "vda"}]}


FIO = {
    "write-direct-psync": fio("write-direct-psync", "write", True, "psync",
                              GB),
    "write-direct-libaio-qd16": fio("write-direct-libaio-qd16", "write", True,
                                    "libaio", 2 * GB, 16),
    "write-buffered-psync-fsync": fio("write-buffered-psync-fsync", "write",
                                      False, "psync", GB, end_fsync=True),
    "read-direct-psync": fio("read-direct-psync", "read", True, "psync",
                             2 * GB),
    "read-direct-libaio-qd16": fio("read-direct-libaio-qd16", "read", True,
                                   "libaio", 4 * GB, 16),
    # Faster than any direct read; must not become the cold-load limit.
    "read-pagecache-psync": fio("read-pagecache-psync", "read", False,
                                "psync", 10 * GB),
}


def load_row(name, cache, seconds, ranks, rss):
    return {"cache": cache, "dest_bytes": STATE, "gb_per_s": STATE / seconds
            / GB, "kind": "load", "name": name, "peak_rss_bytes": rss,
            "rank_seconds": [[seconds] * ranks], "ranks": ranks,
            "samples": [seconds], "save_ranks": 4, "seconds": seconds,
            "split": "cols" if name.endswith("cols") else "rows",
            "storage_bytes_read": STATE, "verified": True}


LOADS = [("load_same", 4), ("load_4to2_rows", 2), ("load_4to2_cols", 2),
         ("load_4to3_rows", 3), ("load_4to3_cols", 3)]

# cairn bench --json: save 2 GB/s, cold loads 4 GB/s, warm loads 8 GB/s.
CAIRN = {
    "async_blocked_seconds": 0.2, "async_total_seconds": 1.1,
    "bytes": STATE, "cold_method": "drop_caches", "cpus": 2,
    "load_seconds": 0.5, "save_seconds": 1.0, "tensors": 193, "ranks": 4,
    "repeat": 1, "tool": "cairn", "version": "0.1.0",
    "memcpy": {"bytes": STATE, "gb_per_s": 10.0, "iterations": 5,
               "parallel_gb_per_s": 16.0, "threads": 2},
    "memcpy_gb_per_s": 10.0, "memcpy_parallel_gb_per_s": 16.0,
    "notes": ["GB/s = state bytes / seconds / 1e9 for every row."],
    "results": [
        {"cache": None, "dest_bytes": STATE, "disk_bytes": STATE + 4096,
         "files": 5, "gb_per_s": 2.0, "kind": "save", "name": "save_sync",
         "peak_rss_bytes": STATE + 50 * MIB, "ranks": 4, "samples": [1.0],
         "seconds": 1.0},
        {"blocked_samples": [0.2], "blocked_seconds": 0.2, "cache": None,
         "dest_bytes": 2 * STATE, "first_blocked_seconds": 1.5,
         "first_seconds": 2.5, "gb_per_s": STATE / 1.1 / GB, "kind": "async",
         "name": "async_save", "peak_rss_bytes": 2 * STATE + 60 * MIB,
         "ranks": 4, "samples": [1.1], "seconds": 1.1,
         "staging_allocations": 564},
    ] + [load_row(n, c, s, r, STATE + 100 * MIB)
         for n, r in LOADS for c, s in (("cold", 0.5), ("warm", 0.25))] + [
        {"cache": "cold", "dest_bytes": 0, "gb_per_s": STATE / 0.6 / GB,
         "kind": "load", "name": "load_sink", "peak_rss_bytes": 300 * MIB,
         "ranks": 1, "samples": [0.6], "seconds": 0.6, "sink_bytes": STATE,
         "memory_budget_bytes": 256 * MIB}],
}


def peer_row(name, kind, seconds, ranks, cache=None):
    row = {"name": name, "kind": kind, "seconds": seconds,
           "gb_per_s": STATE / seconds / GB, "ranks": ranks,
           "peak_rss_bytes": STATE // ranks + 300 * MIB,
           "baseline_rss_bytes": 240 * MIB, "dest_bytes": STATE // ranks,
           "peak_rss_over_dest_bytes": 300 * MIB, "samples": [seconds]}
    if cache:
        row.update(cache=cache, verified=True)
    return row


# torch_peer.py --out: DCP twice as slow as cairn everywhere.
TORCH = {
    "peer": "torch", "torch_version": "1.13.0a0", "bytes": STATE,
    "ranks": 4, "repeat": 1, "cold_method": "drop_caches", "notes": [],
    "results": [
        peer_row("torch_save", "save", 2.5, 1),
        peer_row("torch_load", "load", 0.8, 1, "cold"),
        peer_row("torch_load", "load", 0.5, 1, "warm"),
        peer_row("dcp_save_single_file_per_rank", "save", 2.0, 4),
        peer_row("dcp_save_file_per_tensor", "save", 3.0, 4),
    ] + [peer_row("dcp_" + n, "load", 2 * s, r, c)
         for n, r in LOADS for c, s in (("cold", 0.5), ("warm", 0.25))],
}


def py_doc(scale=1.0, plugin=True):
    """cairn_py_peer.py --out: cairn's rows through the Python API at
    `scale` x the CLI's seconds, and the DCP plugin rows at 1.5 x, unless
    plugin=False (then skipped with import cairn.torch's reason)."""
    rows = []
    for r in CAIRN["results"]:
        row = copy.deepcopy(r)
        row["seconds"] *= scale
        if "blocked_seconds" in row:
            row["blocked_seconds"] *= scale
        rows.append(row)
    if plugin:
        for r in CAIRN["results"]:
            row = copy.deepcopy(r)
            row["name"] = "plugin_" + row["name"]
            row["seconds"] *= 1.5
            if "blocked_seconds" in row:
                row["blocked_seconds"] *= 1.5
            rows.append(row)
    return {"peer": "cairn_py", "cairn_version": "0.1.0",
            "torch_version": "2.13.0+cpu", "bytes": STATE, "ranks": 4,
            "repeat": 1, "cold_method": "drop_caches",
            "plugin_not_measured": None if plugin else
            "cairn.torch not available (ModuleNotFoundError: No module "
            "named 'cairn.torch')",
            "results": rows, "notes": []}


def torch2_doc():
    """A torch 2.13 peer: TORCH plus dcp_async_save (blocked 2.0 s, done
    after 4.0 s)."""
    doc = dict(TORCH, torch_version="2.13.0+cpu")
    row = peer_row("dcp_async_save", "async", 4.0, 4)
    row["blocked_seconds"] = 2.0
    doc["results"] = TORCH["results"] + [row]
    return doc


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, obj):
        with open(os.path.join(self.dir, name), "w") as f:
            if isinstance(obj, str):
                f.write(obj + "\n")
            else:
                json.dump(obj, f)

    def full_run(self, cairn=CAIRN, torch=TORCH):
        for name, doc in FIO.items():
            self.write(f"fio-{name}.json", doc)
        self.write("cairn-2GB.json", cairn)
        self.write("torch-2GB.json", torch)

    def run_report(self):
        """report.py's main on the folder: (report.json, report.md)."""
        with redirect_stdout(io.StringIO()) as stdout:
            self.assertEqual(report.main(["report.py", self.dir]), 0)
        with open(os.path.join(self.dir, "report.json")) as f:
            data = json.load(f)
        with open(os.path.join(self.dir, "report.md")) as f:
            md = f.read()
        self.assertEqual(stdout.getvalue(), md)
        return data, md

    @staticmethod
    def row(data, name, cache=None):
        rows = data["sizes"][0]["rows"]
        return next(r for r in rows
                    if r["row"] == name and r["cache"] == cache)

    @staticmethod
    def target(data, prefix):
        return next(t for t in data["targets"]
                    if t["target"].startswith(prefix))

    def test_limits_and_ratios(self):
        self.full_run()
        data, _ = self.run_report()
        # Fastest write reaching the disk: libaio depth 16, 2 GB/s.
        self.assertEqual(data["limits"]["write"]["job"],
                         "write-direct-libaio-qd16")
        # Fastest direct read, not the page-cached 10 GB/s.
        self.assertAlmostEqual(data["limits"]["cold_read"]["gb_per_s"], 4.0)
        save = self.row(data, "save")
        self.assertAlmostEqual(save["cairn_gb_per_s"], 2.0)
        self.assertAlmostEqual(save["cairn_over_limit"], 1.0)
        # DCP's faster save layout is the one compared: 2.0 s / 1.0 s.
        self.assertEqual(save["dcp_name"], "dcp_save_single_file_per_rank")
        self.assertAlmostEqual(save["speedup_vs_dcp"], 2.0)
        self.assertAlmostEqual(save["speedup_vs_torch"], 2.5)
        cold = self.row(data, "load_4to3_cols", "cold")
        self.assertAlmostEqual(cold["cairn_over_limit"], 1.0)
        self.assertAlmostEqual(cold["speedup_vs_dcp"], 2.0)
        self.assertNotIn("speedup_vs_torch", cold)  # torch.load: same only
        warm = self.row(data, "load_same", "warm")
        # The parallel memcpy figure, 16 GB/s, is the warm limit.
        self.assertAlmostEqual(warm["limit_gb_per_s"], 16.0)
        self.assertAlmostEqual(warm["cairn_over_limit"], 0.5)
        self.assertAlmostEqual(warm["speedup_vs_torch"], 2.0)
        # One process with 4 rank threads: dest + 4 x 256 MiB.
        same = self.row(data, "load_same", "cold")
        self.assertEqual(same["cairn_rss_allowance_bytes"],
                         STATE + 4 * 256 * MIB)
        self.assertEqual(same["dcp_peak_rss_over_dest_bytes"], 300 * MIB)
        self.assertIsNone(self.row(data, "async save, blocked")[
            "cairn_gb_per_s"])

    def test_async_rows_pair_with_dcp_async_save_when_the_peer_ran_it(self):
        # torch 1.13's peer has no dcp_async_save row: no pairing.
        self.full_run()
        data, md = self.run_report()
        self.assertNotIn("speedup_vs_dcp",
                         self.row(data, "async save, blocked"))
        self.assertIn("Async rows have no DCP counterpart", md)
        # A torch 2.x peer: async_save blocked 2.0 s, done after 4.0 s.
        torch2 = dict(TORCH, torch_version="2.11.0")
        row = peer_row("dcp_async_save", "async", 4.0, 4)
        row["blocked_seconds"] = 2.0
        torch2["results"] = TORCH["results"] + [row]
        self.full_run(torch=torch2)
        data, md = self.run_report()
        blocked = self.row(data, "async save, blocked")
        self.assertEqual(blocked["dcp_name"], "dcp_async_save (blocked)")
        self.assertAlmostEqual(blocked["speedup_vs_dcp"],
                               2.0 / blocked["cairn_seconds"])
        total = self.row(data, "async save, total")
        self.assertEqual(total["dcp_name"], "dcp_async_save")
        self.assertAlmostEqual(total["speedup_vs_dcp"],
                               4.0 / total["cairn_seconds"])
        self.assertIn("Async rows pair with DCP's async_save", md)
        # Still 11 rows in the every-row target: async rows are not counted.
        self.assertIn("11 of 11 rows faster",
                      self.target(data, "faster than")["measured"])

    def test_met_targets(self):
        self.full_run()
        data, md = self.run_report()
        results = {t["target"]: t["result"] for t in data["targets"]}
        self.assertEqual(len(results), 9)
        # No cairn_py-2GB.json: the Python targets are not measured.
        for name in ("cairn Python API >= 0.9 x CLI speed on every row",
                     "cairn Python API faster than DCP 1.13.0a0 on every "
                     "row"):
            self.assertEqual(results.pop(name), "not measured")
        self.assertEqual(set(results.values()), {"met"}, results)
        self.assertIn("11 of 11 rows faster",
                      self.target(data, "faster than")["measured"])
        self.assertEqual(self.target(data, "async")["measured"],
                         "0.200 s = 0.200 x 1.000 s")
        self.assertIn("- save >= 0.9 x fastest fio write: **met**", md)

    def test_python_api_beside_the_cli_and_dcp(self):
        self.full_run(torch=torch2_doc())
        self.write("cairn_py-2GB.json", py_doc(scale=1.1))
        data, md = self.run_report()
        save = self.row(data, "save")
        self.assertAlmostEqual(save["py_seconds"], 1.1)
        self.assertAlmostEqual(save["py_over_cli"], 1 / 1.1)
        self.assertAlmostEqual(save["py_vs_dcp"], 2.0 / 1.1)
        self.assertAlmostEqual(save["plugin_seconds"], 1.5)
        self.assertAlmostEqual(save["plugin_over_cli"], 1 / 1.5)
        self.assertAlmostEqual(save["plugin_vs_dcp"], 2.0 / 1.5)
        # Async blocked pairs blocked seconds with blocked seconds.
        blocked = self.row(data, "async save, blocked")
        self.assertAlmostEqual(blocked["py_seconds"], 0.22)
        self.assertAlmostEqual(blocked["py_vs_dcp"], 2.0 / 0.22)
        cols = self.row(data, "load_4to3_cols", "cold")
        self.assertAlmostEqual(cols["py_vs_dcp"], 1.0 / 0.55)
        py_cli = self.target(data, "cairn Python API >= 0.9")
        self.assertEqual(py_cli["result"], "met")
        self.assertIn("13 of 13 rows", py_cli["measured"])
        self.assertAlmostEqual(py_cli["value"], 1 / 1.1)
        py_dcp = self.target(data, "cairn Python API faster than DCP "
                             "2.13.0+cpu")
        self.assertEqual(py_dcp["result"], "met")
        self.assertIn("13 of 13 rows faster", py_dcp["measured"])
        self.assertIn("### 2GB: cairn CLI, Python API and DCP plugin", md)
        self.assertIn("DCP 2.13.0+cpu s", md)
        self.assertIn("| save | - | 1.000 | 1.100 | 0.91x | 1.500 | 0.67x "
                      "| 2.000 | 1.82x | 1.33x | 2.500 |", md)

    def test_python_api_below_the_cli_and_plugin_absent(self):
        self.full_run(torch=torch2_doc())
        self.write("cairn_py-2GB.json", py_doc(scale=1.25, plugin=False))
        data, md = self.run_report()
        self.assertNotIn("plugin_seconds", self.row(data, "save"))
        py_cli = self.target(data, "cairn Python API >= 0.9")
        self.assertEqual(py_cli["result"], "missed")
        self.assertIn("0 of 13 rows", py_cli["measured"])
        self.assertIn("save 0.80x", py_cli["detail"])
        # 1.25 x the CLI is still faster than DCP's 2 x.
        self.assertEqual(self.target(data, "cairn Python API faster")[
            "result"], "met")
        self.assertIn("DCP plugin: not measured (cairn.torch not available",
                      md)
        # Slower than DCP on one row: missed, naming it.
        doc = py_doc(plugin=False)
        for r in doc["results"]:
            if r["name"] == "load_4to2_rows" and r["cache"] == "warm":
                r["seconds"] = 0.6  # DCP 0.5 s
        self.write("cairn_py-2GB.json", doc)
        data, _ = self.run_report()
        t = self.target(data, "cairn Python API faster")
        self.assertEqual(t["result"], "missed")
        self.assertIn("load_4to2_rows warm 0.83x", t["detail"])

    def test_python_api_skipped(self):
        self.full_run()
        self.write("cairn_py.skipped", "--skip-cairn-python given")
        data, md = self.run_report()
        for prefix in ("cairn Python API >= 0.9", "cairn Python API faster"):
            t = self.target(data, prefix)
            self.assertEqual(t["result"], "not measured")
            self.assertEqual(t["detail"], "--skip-cairn-python given")
        self.assertIn("cairn's Python API: not measured "
                      "(--skip-cairn-python given).", md)

    def test_missed_targets(self):
        cairn = copy.deepcopy(CAIRN)
        for r in cairn["results"]:
            if r["name"] == "save_sync":
                r["seconds"] = 1.25  # 1.6 GB/s = 0.8 x the 2 GB/s limit
            if r["name"] == "async_save":
                r["blocked_seconds"] = 0.5  # 0.4 x the sync save
            if r["name"] == "load_4to2_cols" and r["cache"] == "warm":
                r["seconds"] = 0.625  # DCP took 0.5 s
            if r["name"] == "load_4to3_rows" and r["cache"] == "cold":
                r["peak_rss_bytes"] = STATE + 3 * 256 * MIB + 1
            if r["name"] == "load_sink":
                r["peak_rss_bytes"] = 384 * MIB + 1  # the budget + 128 MiB
        self.full_run(cairn=cairn)
        data, md = self.run_report()
        save = self.target(data, "save")
        self.assertEqual(save["result"], "missed")
        self.assertIn("1.60 GB/s (0.80x of 2.00)", save["measured"])
        self.assertEqual(save["required"], ">= 1.80 GB/s")
        self.assertAlmostEqual(save["value"], 1.6)
        self.assertAlmostEqual(save["threshold"], 1.8)
        dcp = self.target(data, "faster than")
        self.assertEqual(dcp["result"], "missed")
        self.assertIn("load_4to2_cols warm 0.80x", dcp["detail"])
        self.assertEqual(self.target(data, "async")["result"], "missed")
        rss = self.target(data, "peak RSS")
        self.assertEqual(rss["result"], "missed")
        self.assertIn("load_4to3_rows cold", rss["detail"])
        self.assertEqual(self.target(data, "cold load")["result"], "met")
        sink = self.target(data, "streaming load")
        self.assertEqual(sink["result"], "missed")
        self.assertEqual(sink["required"], "<= 384 MiB")
        self.assertIn("- save >= 0.9 x fastest fio write: **missed**", md)

    def test_single_memcpy_when_no_parallel_figure(self):
        cairn = copy.deepcopy(CAIRN)
        del cairn["memcpy_parallel_gb_per_s"]
        del cairn["memcpy"]["parallel_gb_per_s"]
        self.full_run(cairn=cairn)
        data, _ = self.run_report()
        warm = self.target(data, "warm load")
        self.assertEqual(warm["detail"], "memcpy on 1 thread")
        self.assertIn("0.80x of 10.00", warm["measured"])
        self.assertEqual(warm["result"], "met")

    def test_repeated_fio_jobs_and_memcpy_samples_give_their_medians(self):
        self.full_run()
        # Two more samples of the libaio write (2 GB/s in FIO): 1.5 and
        # 2.5 GB/s leave its median at 2.0; the psync write's samples 1.0,
        # 3.0 and 1.2 GB/s make it the fastest at 1.2 only if the median
        # were not taken over its samples (its max is 3.0).
        w = "write-direct-libaio-qd16"
        self.write(f"fio-{w}.2.json",
                   fio(w, "write", True, "libaio", 3 * GB // 2, 16))
        self.write(f"fio-{w}.3.json",
                   fio(w, "write", True, "libaio", 5 * GB // 2, 16))
        p = "write-direct-psync"
        self.write(f"fio-{p}.2.json", fio(p, "write", True, "psync", 3 * GB))
        self.write(f"fio-{p}.3.json",
                   fio(p, "write", True, "psync", 6 * GB // 5, runtime=1700))
        # One failed sample of a read: that job's figure is unknown.
        r = "read-direct-libaio-qd16"
        failed = fio(r, "read", True, "libaio", 0, 16)
        failed["jobs"][0]["error"] = 5
        self.write(f"fio-{r}.2.json", failed)
        cairn = copy.deepcopy(CAIRN)
        cairn["memcpy"]["samples"] = [
            {"gb_per_s": 10.0, "parallel_gb_per_s": 16.0},
            {"gb_per_s": 9.0, "parallel_gb_per_s": 30.0},
            {"gb_per_s": 11.0, "parallel_gb_per_s": 15.0}]
        self.write("cairn-2GB.json", cairn)
        data, md = self.run_report()
        write = data["limits"]["write"]
        self.assertEqual(write["job"], w)
        self.assertAlmostEqual(write["gb_per_s"], 2.0)
        self.assertEqual(len(write["samples_gb_per_s"]), 3)
        psync = next(j for j in data["limits"]["jobs"] if j["job"] == p)
        self.assertAlmostEqual(psync["gb_per_s"], 1.2)
        # The runtime beside it is the median sample's, not the first's.
        self.assertEqual(psync["runtime_ms"], 1700)
        # The failed libaio read leaves psync's 2 GB/s as the cold limit.
        self.assertAlmostEqual(data["limits"]["cold_read"]["gb_per_s"], 2.0)
        self.assertIn("failed (fio error 5)", md)
        self.assertIn("| 2.00, 1.50, 2.50 |", md)
        self.assertIn("| 16.00, 30.00, 15.00 |", md)
        warm = self.target(data, "warm load")
        self.assertEqual(warm["detail"], "memcpy on 2 threads, median of 3 "
                         "samples")

    def test_missing_torch_and_fio(self):
        self.write("fio.skipped", "--skip-fio given")
        self.write("torch.skipped", "--skip-torch given")
        self.write("cairn-2GB.json", CAIRN)
        data, md = self.run_report()
        for prefix in ("save", "cold load", "faster than"):
            t = self.target(data, prefix)
            self.assertEqual(t["result"], "not measured", t)
        self.assertIn("--skip-fio given", self.target(data, "save")["detail"])
        self.assertIn("--skip-torch given",
                      self.target(data, "faster than")["detail"])
        # What needs neither is still judged.
        self.assertEqual(self.target(data, "warm load")["result"], "met")
        self.assertIn("fio: not measured (--skip-fio given).", md)
        self.assertIn("PyTorch peer: not measured (--skip-torch given).", md)

    def test_peer_file_absent_and_engine_skipped(self):
        self.full_run()
        os.unlink(os.path.join(self.dir, "torch-2GB.json"))
        os.unlink(os.path.join(self.dir,
                               "fio-read-direct-libaio-qd16.json"))
        self.write("fio-read-direct-io_uring-qd16.skipped",
                   "fio engine io_uring unavailable here: EPERM")
        data, md = self.run_report()
        self.assertEqual(self.target(data, "faster than")["detail"],
                         "no torch-2GB.json")
        # The next fastest direct read is the limit now.
        self.assertAlmostEqual(data["limits"]["cold_read"]["gb_per_s"], 2.0)
        self.assertIn("not measured: fio engine io_uring unavailable here",
                      md)

    def test_cold_rows_skipped(self):
        cairn = copy.deepcopy(CAIRN)
        cairn["cold_method"] = "unavailable"
        cairn["notes"].insert(0, "cold rows skipped: --cold none")
        cairn["results"] = [r for r in cairn["results"]
                            if r["cache"] != "cold"]
        self.full_run(cairn=cairn)
        data, md = self.run_report()
        cold = self.target(data, "cold load")
        self.assertEqual(cold["result"], "not measured")
        self.assertEqual(cold["detail"], "cold rows skipped: --cold none")
        dcp = self.target(data, "faster than")
        self.assertEqual(dcp["result"], "met where measured")
        self.assertIn("not measured: load_same cold", dcp["detail"])
        self.assertIn("| load_same | cold | not measured: cold rows "
                      "skipped: --cold none |", md)

    def test_unreadable_input_is_reported(self):
        self.full_run()
        self.write("torch-2GB.json", "{truncated")
        self.write("cairn-1GB.json", "")
        data, md = self.run_report()
        self.assertIn("could not read torch-2GB.json",
                      self.target(data, "faster than")["detail"])
        self.assertIn("## 1GB: not measured (could not read cairn-1GB.json",
                      md)

    def test_command_line(self):
        self.full_run()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "report.py")
        ok = subprocess.run([sys.executable, script, self.dir],
                            capture_output=True, text=True, check=False)
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("## Targets (issue 6)", ok.stdout)
        missing = subprocess.run(
            [sys.executable, script, os.path.join(self.dir, "nope")],
            capture_output=True, text=True, check=False)
        self.assertEqual(missing.returncode, 1)
        self.assertIn("no such results folder", missing.stderr)


if __name__ == "__main__":
    unittest.main()
