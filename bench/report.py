#!/usr/bin/env python3
"""Report of one run of bench/run.sh: cairn next to the physical limits of the
directory and next to PyTorch checkpointing, and the targets of issue 6.

Usage: python3 bench/report.py RESULTS_DIR

Reads from RESULTS_DIR (what bench/run.sh writes there):
  fio-JOB.json      fio --output-format=json of one sequential job
  fio-JOB.K.json    the same job's K-th sample (run.sh --repeat K, K >= 2):
                    a job's figure is the median of its samples
  fio-JOB.skipped   why that job was not run (e.g. io_uring unavailable)
  fio.skipped       why no fio job was run
  cairn-SIZE.json   cairn bench --json
  torch-SIZE.json   bench/peers/torch_peer.py --out
  torch.skipped     why the peer was not run
  cairn_py-SIZE.json  bench/peers/cairn_py_peer.py --out: cairn's rows
                    through its Python API (and through DCP with cairn's
                    storage plugin, rows plugin_*)
  cairn_py.skipped  why cairn's Python API was not run
  run.json          the machine and the command (optional)
Writes RESULTS_DIR/report.md and RESULTS_DIR/report.json and prints the
markdown. Whatever is missing is reported as "not measured" with its reason.
Standard library only.
"""

import glob
import json
import os
import sys

MIB = 1 << 20
RSS_ALLOWANCE = 256 * MIB  # per process, on top of the destination bytes
SINK_RSS_ALLOWANCE = 128 * MIB  # load_sink: on top of its memory budget

# Thresholds of issue 6.
SAVE_VS_WRITE = 0.9
COLD_VS_READ = 0.9
WARM_VS_MEMCPY = 0.5
ASYNC_VS_SYNC = 0.25
# The Python package against the CLI: at least this fraction of the CLI's
# speed (CLI seconds / Python seconds) on every row.
PY_VS_CLI = 0.9

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"
PARTLY = "met where measured"  # no row missed, but some rows not measured


def read_json(path):
    """(object, None) or (None, reason): a broken input is reported, not
    raised, so that one bad file does not hide the rest of the run."""
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f"could not read {os.path.basename(path)}: {e}"


def read_text(path):
    with open(path) as f:
        return f.read().strip()


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------
def fio_limits(out):
    """The fio jobs of the run and the limits they give."""
    res = {"jobs": [], "skipped": [], "write": None, "cold_read": None,
           "pagecache_read": None, "not_measured": None}
    if os.path.exists(os.path.join(out, "fio.skipped")):
        res["not_measured"] = read_text(os.path.join(out, "fio.skipped"))
        return res
    for path in sorted(glob.glob(os.path.join(out, "fio-*.skipped"))):
        job = os.path.basename(path)[len("fio-"):-len(".skipped")]
        res["skipped"].append({"job": job, "reason": read_text(path)})
    def sample_order(path):  # fio-JOB.json is sample 1, fio-JOB.K.json K
        stem = os.path.basename(path)[:-len(".json")]
        job, _, k = stem.rpartition(".")
        return (job, int(k)) if job and k.isdigit() else (stem, 1)

    samples = {}  # job name -> its samples, in order
    for path in sorted(glob.glob(os.path.join(out, "fio-*.json")),
                       key=sample_order):
        data, err = read_json(path)
        if err:
            res["skipped"].append({"job": os.path.basename(path),
                                   "reason": err})
            continue
        one = fio_job(data)
        samples.setdefault(one["job"], []).append(one)
    res["jobs"] = [merge_samples(s) for s in samples.values()]
    if not res["jobs"]:
        res["not_measured"] = "no fio-*.json in the results folder"

    def fastest(pred):
        jobs = [j for j in res["jobs"] if pred(j) and j["gb_per_s"]]
        return max(jobs, key=lambda j: j["gb_per_s"]) if jobs else None

    # A buffered write counts only with its final fsync: without one fio
    # times the page cache, not the disk.
    res["write"] = fastest(lambda j: j["rw"] == "write"
                           and (j["direct"] or j["fsync"]))
    res["cold_read"] = fastest(lambda j: j["rw"] == "read" and j["direct"])
    res["pagecache_read"] = fastest(lambda j: j["rw"] == "read"
                                    and not j["direct"])
    return res


def fio_job(data):
    """One job of a fio JSON (fio 3.x: jobs[0] with read/write.bw_bytes),
    described from its options rather than its name."""
    job = data["jobs"][0]
    opts = dict(data.get("global options", {}))
    opts.update(job.get("job options", {}))
    rw = opts.get("rw", "read")  # fio's default
    direct = opts.get("direct", "0") == "1"
    engine = opts.get("ioengine", "psync")  # fio's default on Linux
    depth = int(opts.get("iodepth", "1"))
    fsync = (opts.get("end_fsync", "0") == "1"
             or opts.get("fsync_on_close", "0") == "1")
    bw = job.get(rw, {}).get("bw_bytes") if rw in ("read", "write") else None
    label = f"{rw}, " + ("direct" if direct else
                         "buffered + final fsync" if rw == "write" and fsync
                         else "buffered" if rw == "write" else "page-cached")
    label += f", {engine}" + (f" depth {depth}" if depth > 1 else "")
    return {"job": job.get("jobname"), "label": label, "rw": rw,
            "direct": direct, "engine": engine, "iodepth": depth,
            "fsync": fsync, "error": job.get("error", 0),
            "gb_per_s": bw / 1e9 if bw and not job.get("error") else None,
            "bytes": job.get(rw, {}).get("io_bytes"),
            "runtime_ms": job.get(rw, {}).get("runtime")}


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def merge_samples(samples):
    """One job from its samples (run.sh --repeat runs every fio job that
    many times, interleaved with the others): the median bandwidth, as
    cairn's and the peer's rows are the median of theirs. A job with a
    failed sample counts as failed, its limit unknown."""
    job = dict(samples[0])
    job["samples_gb_per_s"] = [j["gb_per_s"] for j in samples]
    failed = [j for j in samples if j["error"] or not j["gb_per_s"]]
    if failed:
        job["error"] = failed[0]["error"]
        job["gb_per_s"] = None
        return job
    job["gb_per_s"] = median(job["samples_gb_per_s"])
    # The bytes and runtime beside it are those of the sample the median
    # names (of an even count, the upper middle one).
    middle = sorted(samples, key=lambda j: j["gb_per_s"])[len(samples) // 2]
    job["bytes"] = middle["bytes"]
    job["runtime_ms"] = middle["runtime_ms"]
    return job


def peer_doc(out, prefix, label):
    """(JSON or None, reason) of a peer's file for one size."""
    skipped = os.path.join(out, f"{prefix}.skipped")
    if os.path.exists(skipped):
        return None, read_text(skipped)
    path = os.path.join(out, f"{prefix}-{label}.json")
    if os.path.exists(path):
        return read_json(path)
    return None, f"no {prefix}-{label}.json"


def sizes(out):
    """[(label, cairn JSON or None, reason, torch JSON or None, reason,
    cairn_py JSON or None, reason)], smallest state first."""
    torch_skip = None
    if os.path.exists(os.path.join(out, "torch.skipped")):
        torch_skip = read_text(os.path.join(out, "torch.skipped"))
    found = []
    for path in glob.glob(os.path.join(out, "cairn-*.json")):
        label = os.path.basename(path)[len("cairn-"):-len(".json")]
        cairn, cairn_err = read_json(path)
        torch_path = os.path.join(out, f"torch-{label}.json")
        if torch_skip:
            torch, torch_err = None, torch_skip
        elif os.path.exists(torch_path):
            torch, torch_err = read_json(torch_path)
        else:
            torch, torch_err = None, f"no torch-{label}.json"
        py, py_err = peer_doc(out, "cairn_py", label)
        found.append((label, cairn, cairn_err, torch, torch_err, py,
                      py_err))
    found.sort(key=lambda s: (s[1] or {}).get("bytes", 0))
    return found


# --------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------
def by_key(doc):
    """Result rows of a cairn or peer JSON by (name, cache)."""
    return {(r["name"], r.get("cache")): r for r in (doc or {}).get("results",
                                                                   [])}


def memcpy_limit(cairn):
    """(GB/s, which): the parallel figure when cairn measured one."""
    n = len((cairn.get("memcpy") or {}).get("samples", []))
    of = f", median of {n} samples" if n > 1 else ""
    par = cairn.get("memcpy_parallel_gb_per_s")
    if par:
        threads = cairn.get("memcpy", {}).get("threads")
        return par, (f"memcpy on {threads} threads" if threads else
                     "memcpy, parallel") + of
    single = cairn.get("memcpy_gb_per_s")
    return (single, "memcpy on 1 thread" + of) if single else (None, None)


def cold_skip_reason(cairn):
    for note in cairn.get("notes", []):
        if note.startswith("cold rows skipped"):
            return note
    return f"cold_method {cairn.get('cold_method')}"


def ratio(a, b):
    return a / b if a is not None and b else None


def size_rows(cairn, torch, limits, py=None):
    """Every row of one size's table, with figures and ratios."""
    c = by_key(cairn)
    t = by_key(torch)
    p = by_key(py)
    write = limits["write"]
    read = limits["cold_read"]
    memcpy, memcpy_which = memcpy_limit(cairn)
    dcp_saves = [r for (n, _), r in t.items() if n.startswith("dcp_save_")]
    # DCP's faster save layout is the one to beat (single_file_per_rank
    # and file-per-tensor are both measured).
    dcp_save = min(dcp_saves, key=lambda r: r["seconds"]) if dcp_saves \
        else None
    rows = []

    def add(label, name, cache, seconds, limit, limit_name, dcp, torch_row,
            rate=True):
        row = c.get((name, cache))
        r = {"row": label, "cairn_name": name, "cache": cache}
        if row is None or seconds(row) is None:
            r["not_measured"] = (cold_skip_reason(cairn) if cache == "cold"
                                 else f"no {name} row in cairn's JSON")
            rows.append(r)
            return
        sec = seconds(row)
        gbps = cairn["bytes"] / sec / 1e9 if rate else None
        r.update({"cairn_seconds": sec, "cairn_gb_per_s": gbps,
                  "limit_name": limit_name, "limit_gb_per_s": limit,
                  "cairn_over_limit": ratio(gbps, limit),
                  "cairn_peak_rss_bytes": row.get("peak_rss_bytes"),
                  "cairn_dest_bytes": row.get("dest_bytes"),
                  "ranks": row.get("ranks")})
        if row.get("dest_bytes") is not None and row.get("ranks"):
            # cairn runs its ranks as threads of one process, so that one
            # process is allowed 256 MiB for each of its ranks.
            r["cairn_rss_allowance_bytes"] = (row["dest_bytes"]
                                              + RSS_ALLOWANCE * row["ranks"])
        for who, peer in (("dcp", dcp), ("torch", torch_row)):
            if peer is None:
                continue
            r[f"{who}_name"] = peer["name"]
            r[f"{who}_seconds"] = peer["seconds"]
            r[f"speedup_vs_{who}"] = ratio(peer["seconds"], sec)
        if dcp is not None and "peak_rss_over_dest_bytes" in dcp:
            r["dcp_peak_rss_bytes"] = dcp["peak_rss_bytes"]
            r["dcp_peak_rss_over_dest_bytes"] = dcp["peak_rss_over_dest_bytes"]
        # cairn's Python API (py_) and DCP with cairn's storage plugin
        # (plugin_), the same row: speed against the CLI (CLI s / s) and
        # against DCP (DCP s / s).
        for who, key in (("py", name), ("plugin", "plugin_" + name)):
            other = p.get((key, cache))
            if other is None or seconds(other) is None:
                continue
            r[f"{who}_seconds"] = seconds(other)
            r[f"{who}_over_cli"] = ratio(sec, seconds(other))
            if dcp is not None:
                r[f"{who}_vs_dcp"] = ratio(dcp["seconds"], seconds(other))
            if other.get("peak_rss_bytes") is not None:
                r[f"{who}_peak_rss_bytes"] = other["peak_rss_bytes"]
        rows.append(r)

    def secs(row):
        return row.get("seconds")

    wname = write["label"] if write else None
    wgbps = write["gb_per_s"] if write else None
    add("save", "save_sync", None, secs, wgbps, wname or "no fio write",
        dcp_save, t.get(("torch_save", None)))
    # Blocking time is not a transfer: no rate, no limit. DCP's async_save
    # (torch 2.x peers) pairs with both rows: its blocking time, and its
    # time until the future is done.
    dcp_async = t.get(("dcp_async_save", None))
    dcp_blocked = None
    if dcp_async is not None and dcp_async.get("blocked_seconds") is not None:
        dcp_blocked = {"name": "dcp_async_save (blocked)",
                       "seconds": dcp_async["blocked_seconds"]}
    add("async save, blocked", "async_save", None,
        lambda r: r.get("blocked_seconds"), None, None, dcp_blocked, None,
        rate=False)
    add("async save, total", "async_save", None, secs, wgbps,
        wname or "no fio write", dcp_async, None)
    loads = []
    for (name, _), row in c.items():
        # load_sink streams into a sink, not destinations: its own target.
        if (row.get("kind") == "load" and name not in loads
                and name != "load_sink"):
            loads.append(name)
    for name in loads:
        for cache in ("cold", "warm"):
            if cache == "cold":
                limit = read["gb_per_s"] if read else None
                lname = read["label"] if read else "no fio direct read"
            else:
                limit, lname = memcpy, memcpy_which or "no memcpy figure"
            torch_row = (t.get(("torch_load", cache)) if name == "load_same"
                         else None)
            add(name, name, cache, secs, limit, lname,
                t.get(("dcp_" + name, cache)), torch_row)
    return rows


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------
def targets_for_size(label, cairn, torch, torch_err, limits, rows,
                     py=None, py_err=None):
    """One entry per target of issue 6 for this size."""
    by_row = {(r["row"], r["cache"]): r for r in rows}

    def get(label, cache=None):
        return by_row.get((label, cache), {
            "not_measured": f"no {label} row in cairn's JSON"})

    memcpy, memcpy_which = memcpy_limit(cairn)
    out = []

    def entry(target, result, measured, required, detail="", value=None,
              threshold=None, unit=None):
        # measured/required are for people; value/threshold for scripts.
        out.append({"target": target, "size": label, "result": result,
                    "measured": measured, "required": required,
                    "detail": detail, "value": value, "threshold": threshold,
                    "unit": unit})

    def vs_limit(target, row, limit, factor, limit_missing):
        if "not_measured" in row:
            entry(target, NOT_MEASURED, "-", "-", row["not_measured"])
        elif limit is None:
            entry(target, NOT_MEASURED, fmt_gbps(row["cairn_gb_per_s"]),
                  "-", limit_missing, value=row["cairn_gb_per_s"],
                  unit="GB/s")
        else:
            ok = row["cairn_gb_per_s"] >= factor * limit
            entry(target, MET if ok else MISSED,
                  f"{fmt_gbps(row['cairn_gb_per_s'])} GB/s "
                  f"({fmt_ratio(row['cairn_gb_per_s'] / limit)} of "
                  f"{fmt_gbps(limit)})",
                  f">= {fmt_gbps(factor * limit)} GB/s", row["limit_name"],
                  value=row["cairn_gb_per_s"], threshold=factor * limit,
                  unit="GB/s")

    fio_missing = limits["not_measured"] or "no such fio job in this run"
    vs_limit(f"save >= {SAVE_VS_WRITE} x fastest fio write",
             get("save"),
             limits["write"] and limits["write"]["gb_per_s"], SAVE_VS_WRITE,
             fio_missing)
    vs_limit(f"cold load >= {COLD_VS_READ} x fastest fio direct read",
             get("load_same", "cold"),
             limits["cold_read"] and limits["cold_read"]["gb_per_s"],
             COLD_VS_READ, fio_missing)
    vs_limit(f"warm load >= {WARM_VS_MEMCPY} x memcpy",
             get("load_same", "warm"), memcpy, WARM_VS_MEMCPY,
             "cairn measured no memcpy")

    # Every save and load row (the list; async rows are shown beside
    # DCP's async_save where the peer ran it, but not counted here).
    target = "faster than torch.distributed.checkpoint on every row"
    comparable = [r for r in rows if r["cairn_name"] != "async_save"]
    paired = [r for r in comparable if "speedup_vs_dcp" in r]
    skipped = [r for r in comparable if "not_measured" in r]
    unpaired = [r for r in comparable
                if "not_measured" not in r and "speedup_vs_dcp" not in r]
    if torch is None:
        entry(target, NOT_MEASURED, "-", "> 1.00x", torch_err)
    elif not paired:
        entry(target, NOT_MEASURED, "-", "> 1.00x",
              "no DCP rows pair with cairn's")
    else:
        slow = [r for r in paired if r["speedup_vs_dcp"] <= 1]
        worst = min(paired, key=lambda r: r["speedup_vs_dcp"])
        detail = (", ".join(f"{row_name(r)} {fmt_ratio(r['speedup_vs_dcp'])}"
                            for r in slow) if slow else
                  f"slowest: {row_name(worst)} "
                  f"{fmt_ratio(worst['speedup_vs_dcp'])}")
        if unpaired:
            detail += ("; no DCP figure for " +
                       ", ".join(row_name(r) for r in unpaired))
        if skipped:
            detail += "; not measured: " + ", ".join(
                row_name(r) for r in skipped)
        entry(target, MISSED if slow else PARTLY if unpaired or skipped
              else MET,
              f"{len(paired) - len(slow)} of {len(paired)} rows faster",
              "every row > 1.00x", ("slower: " if slow else "") + detail,
              value=worst["speedup_vs_dcp"], threshold=1.0,
              unit="x (DCP s / cairn s, slowest row)")

    # cairn's Python API: every row the CLI has, async ones included.
    target = (f"cairn Python API >= {PY_VS_CLI} x CLI speed on every row")
    measured = [r for r in rows if "not_measured" not in r]
    paired = [r for r in measured if r.get("py_over_cli") is not None]
    if py is None:
        entry(target, NOT_MEASURED, "-", f">= {PY_VS_CLI:.2f}x", py_err)
    elif not paired:
        entry(target, NOT_MEASURED, "-", f">= {PY_VS_CLI:.2f}x",
              "no Python API row pairs with the CLI's")
    else:
        slow = [r for r in paired if r["py_over_cli"] < PY_VS_CLI]
        worst = min(paired, key=lambda r: r["py_over_cli"])
        detail = (", ".join(f"{row_name(r)} {fmt_ratio(r['py_over_cli'])}"
                            for r in slow) if slow else
                  f"slowest: {row_name(worst)} "
                  f"{fmt_ratio(worst['py_over_cli'])}")
        unpaired = [r for r in measured if r.get("py_over_cli") is None]
        if unpaired:
            detail += "; not measured: " + ", ".join(
                row_name(r) for r in unpaired)
        entry(target, MISSED if slow else PARTLY if unpaired else MET,
              f"{len(paired) - len(slow)} of {len(paired)} rows at "
              f">= {PY_VS_CLI:.2f}x", f"every row >= {PY_VS_CLI:.2f}x",
              ("below: " if slow else "") + detail,
              value=worst["py_over_cli"], threshold=PY_VS_CLI,
              unit="x (CLI s / Python s, slowest row)")

    # cairn's Python API against the peer's DCP: every row DCP has,
    # async_save's blocked and total included (torch 2.x has it).
    version = (torch or {}).get("torch_version", "")
    target = (f"cairn Python API faster than DCP{' ' + version if version else ''}"
              f" on every row")
    dpaired = [r for r in paired if r.get("py_vs_dcp") is not None]
    if py is None or torch is None:
        entry(target, NOT_MEASURED, "-", "> 1.00x",
              py_err if py is None else torch_err)
    elif not dpaired:
        entry(target, NOT_MEASURED, "-", "> 1.00x",
              "no DCP rows pair with the Python API's")
    else:
        slow = [r for r in dpaired if r["py_vs_dcp"] <= 1]
        worst = min(dpaired, key=lambda r: r["py_vs_dcp"])
        detail = (", ".join(f"{row_name(r)} {fmt_ratio(r['py_vs_dcp'])}"
                            for r in slow) if slow else
                  f"slowest: {row_name(worst)} "
                  f"{fmt_ratio(worst['py_vs_dcp'])}")
        unpaired = [r for r in rows if r.get("py_vs_dcp") is None]
        if unpaired:
            detail += "; no pair for " + ", ".join(
                row_name(r) for r in unpaired)
        entry(target, MISSED if slow else PARTLY if unpaired else MET,
              f"{len(dpaired) - len(slow)} of {len(dpaired)} rows faster",
              "every row > 1.00x", ("slower: " if slow else "") + detail,
              value=worst["py_vs_dcp"], threshold=1.0,
              unit="x (DCP s / Python s, slowest row)")

    target = f"async blocked <= {ASYNC_VS_SYNC} x sync save"
    blocked = get("async save, blocked")
    save = get("save")
    if "not_measured" in blocked or "not_measured" in save:
        entry(target, NOT_MEASURED, "-", "-",
              blocked.get("not_measured") or save.get("not_measured"))
    else:
        r = blocked["cairn_seconds"] / save["cairn_seconds"]
        entry(target, MET if r <= ASYNC_VS_SYNC else MISSED,
              f"{fmt_s(blocked['cairn_seconds'])} s = {r:.3f} x "
              f"{fmt_s(save['cairn_seconds'])} s",
              f"<= {fmt_s(ASYNC_VS_SYNC * save['cairn_seconds'])} s",
              value=blocked["cairn_seconds"],
              threshold=ASYNC_VS_SYNC * save["cairn_seconds"], unit="s")

    target = "peak RSS during load <= dest + 256 MiB per process"
    loads = [r for r in rows if r["cache"] is not None
             and "cairn_rss_allowance_bytes" in r
             and r.get("cairn_peak_rss_bytes") is not None]
    if not loads:
        entry(target, NOT_MEASURED, "-", "-", "no load row with peak RSS")
    else:
        worst = max(loads, key=lambda r: r["cairn_peak_rss_bytes"]
                    - r["cairn_rss_allowance_bytes"])
        over = [r for r in loads
                if r["cairn_peak_rss_bytes"] > r["cairn_rss_allowance_bytes"]]
        entry(target, MISSED if over else MET,
              f"worst {row_name(worst)}: "
              f"{fmt_mib(worst['cairn_peak_rss_bytes'])} MiB",
              f"<= {fmt_mib(worst['cairn_rss_allowance_bytes'])} MiB",
              (("over: " + ", ".join(row_name(r) for r in over) + "; ")
               if over else "") + "cairn: one process, its ranks as threads: "
              "allowed dest + 256 MiB x ranks",
              value=worst["cairn_peak_rss_bytes"],
              threshold=worst["cairn_rss_allowance_bytes"], unit="bytes")

    # Issue 35: a streaming load holds its budget, not the state.
    target = "streaming load peak RSS <= budget + 128 MiB (load_sink)"
    sink = next((r for r in (cairn or {}).get("results", [])
                 if r.get("name") == "load_sink"), None)
    if (sink is None or not sink.get("memory_budget_bytes")
            or sink.get("peak_rss_bytes") is None):
        entry(target, NOT_MEASURED, "-", "-",
              "no load_sink row with a budget (cairn bench --phases sink)")
    else:
        limit = sink["memory_budget_bytes"] + SINK_RSS_ALLOWANCE
        entry(target, MET if sink["peak_rss_bytes"] <= limit else MISSED,
              f"{fmt_mib(sink['peak_rss_bytes'])} MiB",
              f"<= {fmt_mib(limit)} MiB",
              f"one rank streams {fmt_mib(sink.get('sink_bytes'))} MiB into "
              f"a sink that drops it, budget "
              f"{fmt_mib(sink['memory_budget_bytes'])} MiB",
              value=sink["peak_rss_bytes"], threshold=limit, unit="bytes")
    return out


def row_name(r):
    return r["row"] + (f" {r['cache']}" if r["cache"] else "")


# --------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------
def fmt_s(v):
    return "-" if v is None else f"{v:.4f}" if v < 0.1 else f"{v:.3f}"


def fmt_gbps(v):
    return "-" if v is None else f"{v:.2f}"


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def fmt_mib(v):
    return "-" if v is None else f"{v / MIB:.0f}"


def fmt_samples(values):
    """The samples of a median, or "-" when there was one."""
    if len(values) < 2:
        return "-"
    return ", ".join(fmt_gbps(v) if v else "failed" for v in values)


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def limits_md(limits, size_docs, run):
    md = ["## Physical limits", ""]
    if run.get("fio_file_bytes") and not limits["not_measured"]:
        md += [f"fio on one {int(run['fio_file_bytes']) / MIB:.0f} MiB file "
               f"in the directory, each job stopped after the file or "
               f"{run.get('fio_runtime_s', '?')} s.", ""]
    if limits["not_measured"]:
        md.append(f"fio: not measured ({limits['not_measured']}).")
    else:
        best = {id(limits[k]) for k in ("write", "cold_read")
                if limits[k]}
        table = []
        for j in sorted(limits["jobs"], key=lambda j: (j["rw"] != "write",
                                                       not j["direct"],
                                                       j["label"])):
            gbps = fmt_gbps(j["gb_per_s"])
            if id(j) in best:
                gbps = f"**{gbps}** (fastest)"
            elif j["error"]:
                gbps = f"failed (fio error {j['error']})"
            table.append((j["label"], j["job"], gbps,
                          fmt_samples(j.get("samples_gb_per_s", []))))
        for s in limits["skipped"]:
            table.append(("-", s["job"], f"not measured: {s['reason']}",
                          "-"))
        md += md_table(["fio sequential, 1 MiB blocks", "job",
                        "GB/s (median)", "samples GB/s"], table)
        md += ["", "The save limit is the fastest write that reaches the disk "
               "(direct, or buffered with a final fsync); the cold-load limit "
               "is the fastest direct read. With several samples (run.sh "
               "--repeat) each job ran that many times, the jobs taking "
               "turns, and its figure is the median of its samples."]
    mem = []
    for label, cairn, *_ in size_docs:
        if cairn and cairn.get("memcpy_gb_per_s"):
            m = cairn.get("memcpy", {})
            samples = m.get("samples", [])
            mem.append((label, fmt_gbps(cairn["memcpy_gb_per_s"]),
                        f"{fmt_gbps(cairn.get('memcpy_parallel_gb_per_s'))} "
                        f"({m.get('threads', '?')} threads)",
                        fmt_samples([x.get("parallel_gb_per_s")
                                     or x.get("gb_per_s")
                                     for x in samples])))
    if mem:
        md += ["", "Host memcpy bandwidth, measured by `cairn bench` with a "
               "buffer of the state's size, 1 GiB at most (the median of its "
               "samples, "
               "each the best of its copies; with --repeat, one sample "
               "after each warm load_same sample):", ""]
        md += md_table(["state", "1 thread GB/s", "all cores GB/s",
                        "samples, all cores GB/s"], mem)
    return md


def size_md(label, cairn, rows, torch, torch_err):
    md = [f"## {label}: {cairn['bytes']:,} bytes, {cairn.get('tensors', '?')} "
          f"tensors, {cairn.get('ranks')} save ranks, "
          f"repeat {cairn.get('repeat')}", ""]
    memcpy, which = memcpy_limit(cairn)
    if memcpy:
        md.append(f"Limit for warm loads: {which} "
                  f"({fmt_gbps(memcpy)} GB/s).")
    if torch is None:
        md.append(f"PyTorch peer: not measured ({torch_err}).")
    else:
        md.append(f"PyTorch peer: torch {torch.get('torch_version')}, "
                  f"cold={torch.get('cold_method')}.")
    md.append("")
    header = ["row", "cache", "cairn s", "cairn GB/s", "limit GB/s",
              "cairn/limit", "DCP s", "cairn vs DCP", "torch.save/load s",
              "cairn vs torch", "cairn peak RSS / allowed MiB",
              "DCP peak RSS - dest, MiB/process"]
    table = []
    for r in rows:
        if "not_measured" in r:
            table.append([r["row"], r["cache"] or "-",
                          f"not measured: {r['not_measured']}"]
                         + [""] * (len(header) - 3))
            continue
        rss = "-"
        if r.get("cairn_rss_allowance_bytes"):
            rss = (f"{fmt_mib(r['cairn_peak_rss_bytes'])} / "
                   f"{fmt_mib(r['cairn_rss_allowance_bytes'])}")
        table.append([
            r["row"], r["cache"] or "-", fmt_s(r["cairn_seconds"]),
            fmt_gbps(r["cairn_gb_per_s"]), fmt_gbps(r["limit_gb_per_s"]),
            fmt_ratio(r["cairn_over_limit"]), fmt_s(r.get("dcp_seconds")),
            fmt_ratio(r.get("speedup_vs_dcp")), fmt_s(r.get("torch_seconds")),
            fmt_ratio(r.get("speedup_vs_torch")), rss,
            fmt_mib(r.get("dcp_peak_rss_over_dest_bytes"))])
    md += md_table(header, table)
    save = next((r for r in rows if r["row"] == "save"), {})
    notes = []
    if save.get("dcp_name"):
        notes.append(f"DCP save is its faster layout, {save['dcp_name']}.")
    async_note = (
        "Async rows pair with DCP's async_save (blocked: until it returned; "
        "total: until its future was done and the directory fsynced); they "
        "are not part of the every-row target."
        if any("dcp_name" in r for r in rows if r["cairn_name"] == "async_save")
        else "Async rows have no DCP counterpart: this torch's DCP has no "
        "async_save (torch 1.13), or the peer did not run it.")
    notes.append("cairn vs DCP / torch = peer seconds / cairn seconds "
                 "(above 1.00x: cairn is faster). GB/s = state bytes / "
                 "seconds / 1e9 on every row. " + async_note)
    rss = ("Peak RSS: cairn runs its ranks as threads of one process, "
           "allowed its destination bytes + 256 MiB x ranks; the peer runs "
           "one process per rank, each allowed its own destination + 256 MiB")
    baseline = max((r.get("baseline_rss_bytes", 0)
                    for r in (torch or {}).get("results", [])), default=0)
    if baseline:
        rss += (f", of which Python and torch take {fmt_mib(baseline)} MiB "
                f"before any tensor exists")
    notes.append(rss + ".")
    return md + [""] + notes


def python_md(label, rows, torch, py, py_err):
    """The second table of a size: the same rows through cairn's CLI, its
    Python API and DCP with its storage plugin, beside DCP and
    torch.save/load."""
    md = [f"### {label}: cairn CLI, Python API and DCP plugin against "
          f"PyTorch", ""]
    if py is None:
        return md + [f"cairn's Python API: not measured ({py_err})."]
    dcp = f"DCP {torch['torch_version']}" if torch else "DCP"
    md.append(f"cairn {py.get('cairn_version')} Python API on torch "
              f"{py.get('torch_version')}, cold={py.get('cold_method')}; "
              + (f"DCP plugin: not measured "
                 f"({py['plugin_not_measured']})."
                 if py.get("plugin_not_measured") else
                 "DCP plugin: cairn.torch.StorageWriter/StorageReader."))
    md.append("")
    header = ["row", "cache", "CLI s", "Python API s", "Python / CLI",
              "DCP plugin s", "plugin / CLI", f"{dcp} s",
              f"Python vs {dcp}", f"plugin vs {dcp}", "torch.save/load s"]
    table = []
    for r in rows:
        if "not_measured" in r:
            table.append([r["row"], r["cache"] or "-",
                          f"not measured: {r['not_measured']}"]
                         + [""] * (len(header) - 3))
            continue
        table.append([
            r["row"], r["cache"] or "-", fmt_s(r["cairn_seconds"]),
            fmt_s(r.get("py_seconds")), fmt_ratio(r.get("py_over_cli")),
            fmt_s(r.get("plugin_seconds")),
            fmt_ratio(r.get("plugin_over_cli")), fmt_s(r.get("dcp_seconds")),
            fmt_ratio(r.get("py_vs_dcp")), fmt_ratio(r.get("plugin_vs_dcp")),
            fmt_s(r.get("torch_seconds"))])
    md += md_table(header, table)
    md += ["", f"Python / CLI = CLI seconds / Python API seconds (target "
           f">= {PY_VS_CLI:.2f}x: the package keeps the CLI's speed); "
           f"vs {dcp} = DCP seconds / cairn seconds (above 1.00x cairn is "
           f"faster). The CLI runs its ranks as threads of one process; "
           f"the Python API and DCP run one process per rank over gloo. "
           f"A blank: that tool has no such row."]
    return md


def targets_md(targets):
    md = ["## Targets (issue 6)", ""]
    for name in dict.fromkeys(t["target"] for t in targets):
        results = [t["result"] for t in targets if t["target"] == name]
        overall = (MISSED if MISSED in results else
                   MET if all(r == MET for r in results) else
                   NOT_MEASURED if all(r == NOT_MEASURED for r in results)
                   else PARTLY)
        md.append(f"- {name}: **{overall}**")
    md.append("")
    md += md_table(["target", "size", "result", "measured", "required",
                    "detail"],
                   [(t["target"], t["size"],
                     f"**{t['result']}**" if t["result"] == MISSED
                     else t["result"], t["measured"], t["required"],
                     t["detail"]) for t in targets])
    return md


def build(out):
    run, run_err = {}, None
    if os.path.exists(os.path.join(out, "run.json")):
        run, run_err = read_json(os.path.join(out, "run.json"))
    limits = fio_limits(out)
    size_docs = sizes(out)
    report = {"run": run or {}, "limits": limits, "sizes": [], "targets": []}
    md = ["# cairn benchmark report", ""]
    if run_err:
        md += [f"Machine and command unknown ({run_err}).", ""]
    if run:
        md += [f"{run.get('date', '?')} on {run.get('host', '?')} "
               f"({run.get('cpus', '?')} CPUs, {run.get('kernel', '?')}); "
               f"directory {run.get('dir', '?')} on {run.get('device', '?')} "
               f"({run.get('filesystem', '?')}); "
               f"{run.get('cairn_version', 'cairn ?')}, "
               f"fio {run.get('fio_version', '?')}"
               f", torch {run.get('torch_version', '?')}.", "",
               f"Command: `{run.get('command', '?')}`", ""]
    md += limits_md(limits, size_docs, run or {})
    if not size_docs:
        md += ["", "cairn: not measured (no cairn-*.json in the results "
               "folder)."]
    for label, cairn, cairn_err, torch, torch_err, py, py_err in size_docs:
        md.append("")
        if cairn is None:
            md.append(f"## {label}: not measured ({cairn_err})")
            continue
        rows = size_rows(cairn, torch, limits, py)
        targets = targets_for_size(label, cairn, torch, torch_err, limits,
                                   rows, py, py_err)
        report["sizes"].append({
            "size": label, "bytes": cairn["bytes"],
            "ranks": cairn.get("ranks"),
            "cold_method": cairn.get("cold_method"),
            "memcpy_limit": dict(zip(("gb_per_s", "which"),
                                     memcpy_limit(cairn))),
            "torch": ({"torch_version": torch.get("torch_version"),
                       "cold_method": torch.get("cold_method")}
                      if torch else {"not_measured": torch_err}),
            "cairn_py": ({"cairn_version": py.get("cairn_version"),
                          "torch_version": py.get("torch_version"),
                          "cold_method": py.get("cold_method"),
                          "plugin_not_measured":
                              py.get("plugin_not_measured")}
                         if py else {"not_measured": py_err}),
            "rows": rows})
        report["targets"] += targets
        md += size_md(label, cairn, rows, torch, torch_err)
        md += [""] + python_md(label, rows, torch, py, py_err)
    if report["targets"]:
        md += [""] + targets_md(report["targets"])
    return report, "\n".join(md) + "\n"


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[1]
    if not os.path.isdir(out):
        print(f"report.py: {out}: no such results folder", file=sys.stderr)
        return 1
    report, md = build(out)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
