#!/usr/bin/env python3
"""cairn through its Python API, for cairn's benchmark harness.

The rows of `cairn bench` (the CLI: ranks as threads of one C++ process),
timed the way a Python training job calls cairn, on the tensors of the
model JSON that `cairn bench --model-out` wrote:

  save_sync            cairn.save(state, path)
  async_save           cairn.AsyncSaver().save(state, path) twice, the
                       second timed: until save() returned (blocked) and
                       until its future's result() returned (seconds)
  load_same, load_WtoW2_rows/_cols, load_WtoW1_rows/_cols
                       cairn.load(state, path) of the save_sync checkpoint
                       into W, W/2 and W-1 ranks, split on dim 0 (rows) or
                       dim 1 (cols), cold and warm

and the same through torch.distributed.checkpoint with cairn's storage
plugin (rows named plugin_<row>):

  dcp.save(state, storage_writer=cairn.torch.StorageWriter(path))
  dcp.async_save(state, storage_writer=cairn.torch.StorageWriter(path))
  dcp.load(state, storage_reader=cairn.torch.StorageReader(path))

The plugin rows are skipped, with the reason in the JSON's
plugin_not_measured, when `import cairn.torch` fails.

Ranks are torch.multiprocessing (spawn) processes, one per rank, joined
by torch.distributed over gloo on 127.0.0.1; cairn is called with
comm=None, i.e. over the gloo group it makes for itself in an initialized
torch.distributed job. The state is a dict of DTensors on a 1-D CPU
DeviceMesh of the W ranks with placement Shard(d) (0-d tensors plain and
replicated), each rank filling its own part with the values torch_peer.py
and `cairn bench` use. Destinations are allocated, wrapped and filled (NaN)
before the timer; every element is checked after each load, outside the
timer; a wrong byte fails the run. Cold: sync + drop_caches before the
timer; warm: the checkpoint read twice before it (after a drop), as
torch_peer.py and `cairn bench` do. Timing: a barrier, then each rank's
CLOCK_MONOTONIC around the call; a sample is the last end minus the first
start; --repeat N gives the median of N samples, each in fresh processes.

Usage:
  python bench/peers/cairn_py_peer.py --model MODEL.json --dir DIR \\
      [--ranks 4] [--repeat 1] [--cold auto|drop|none] [--out RESULT.json] \\
      [--only LIST] [--no-plugin] [--keep] [--timeout SECONDS]

Needs torch 2.x (DTensor) and the cairn package in the same Python.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer as tp  # noqa: E402  (the shared values, cache and workers)

def log(msg):
    print(f"[cairn_py_peer {time.strftime('%H:%M:%S')}] {msg}",
          file=sys.stderr, flush=True)


def plugin_module():
    """(cairn.torch, None), or (None, why it is not available)."""
    try:
        import cairn.torch as plugin
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        return None, f"cairn.torch not available ({type(e).__name__}: {e})"
    missing = [n for n in ("StorageWriter", "StorageReader")
               if not hasattr(plugin, n)]
    if missing:
        return None, (f"cairn.torch not available (it has no "
                      f"{', '.join(missing)})")
    return plugin, None


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------
def build_dtensor_state(tensors, mesh, split_dim, fill):
    """{fqn: DTensor Shard(d) on `mesh`} (0-d tensors: plain), and
    {fqn: (global offsets, local tensor)} for the check. fill: 'data' or
    'nan'. DTensor's Shard splits as torch.chunk does (ceil(n/W) rows per
    rank, the last ranks short or empty); `cairn bench` splits n*k//W. The
    state's bytes are the same; the ranks' parts differ by at most a row
    or column of each tensor."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import (
        compute_local_shape_and_global_offset)
    state, local = {}, {}
    for t in tensors:
        fqn, shape = t["fqn"], t["shape"]
        if not shape:
            buf = torch.empty([], dtype=torch.float32)
            if fill == "data":
                tp.fill_block(buf, fqn, shape, [])
            else:
                buf.fill_(float("nan"))
            state[fqn] = buf
            local[fqn] = ([], buf)
            continue
        d = split_dim if len(shape) > 1 else 0
        placements = [Shard(d)]
        lshape, offsets = compute_local_shape_and_global_offset(
            torch.Size(shape), mesh, placements)
        buf = torch.empty(list(lshape), dtype=torch.float32)
        if fill == "data":
            tp.fill_block(buf, fqn, shape, list(offsets))
        else:
            buf.fill_(float("nan"))
        state[fqn] = DTensor.from_local(
            buf, mesh, placements, run_check=False, shape=torch.Size(shape),
            stride=tuple(tp.row_major_strides(shape)))
        local[fqn] = (list(offsets), buf)
    return state, local


def verify_state(state, local, shapes, what):
    """Every element of every local part, and that each part was filled in
    place (a load that replaced a tensor would not fill the caller's)."""
    checked = 0
    for fqn, (offsets, buf) in local.items():
        obj = state[fqn]
        got = obj.to_local() if hasattr(obj, "to_local") else obj
        if buf.numel() and got.data_ptr() != buf.data_ptr():
            raise RuntimeError(f"VERIFY FAILED {what}: {fqn} was replaced, "
                               f"not filled in place")
        tp.check_block(buf, fqn, shapes[fqn], offsets, what)
        checked += buf.numel() * buf.element_size()
    return checked


SAVE_PHASES = ("planning", "prepare", "write", "commit")
LOAD_PHASES = ("metadata", "planning", "read", "broadcast", "copy", "staging")


def library_diagnostics(result, phases):
    """What the C++ library says it spent (its own clock) of a timed call;
    the rest of the call is the Python side's."""
    return {"library_seconds": float(result.seconds),
            "phase_seconds": {p: float(getattr(result.phases, p))
                              for p in phases}}


def rank_body(spec, rank, world, port):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import cairn
    kind = spec["kind"]
    out = {"rank": rank}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=world, timeout=datetime.timedelta(seconds=spec["timeout"]))
    # As torch_peer.py: each of W processes gets its share of the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out["torch_threads"] = torch.get_num_threads()
    mesh = init_device_mesh("cpu", (world,))
    out["baseline_rss_bytes"] = tp.maxrss_bytes()
    plugin = None
    if kind.startswith("plugin_"):
        plugin, why = plugin_module()
        if plugin is None:
            raise RuntimeError(why)
    else:
        # comm=None makes cairn create its gloo group (dist.new_group, a
        # collective) on its first call in this job. A training job pays
        # that once; make it here, before any timer, as the CLI's ranks
        # and DCP's default group exist before theirs.
        t = time.monotonic()
        cairn._comm.resolve(None)
        out["comm_setup_seconds"] = time.monotonic() - t

    def prepare_cache():
        dist.barrier()
        if rank == 0:
            if spec.get("cache") == "cold":
                tp.drop_caches()
            elif spec.get("cache") == "warm":
                tp.prewarm(spec["path"], spec.get("drop", False))
        dist.barrier()

    shapes = {t["fqn"]: t["shape"] for t in spec["tensors"]}
    split = spec.get("split_dim", 0)
    fill = "nan" if kind.endswith("load") else "data"
    state, local = build_dtensor_state(spec["tensors"], mesh, split, fill)
    out["dest_bytes"] = tp.local_bytes(
        {f: [blk] for f, blk in local.items()})

    if kind in ("cairn_save", "plugin_save"):
        dist.barrier()
        t0 = time.monotonic()
        if kind == "cairn_save":
            result = cairn.save(state, spec["path"])
        else:
            dcp.save(state, storage_writer=plugin.StorageWriter(spec["path"]))
        t1 = time.monotonic()
        out["peak_rss_bytes"] = tp.maxrss_bytes()
        if kind == "cairn_save":
            out.update(library_diagnostics(result, SAVE_PHASES))
    elif kind in ("cairn_async_save", "plugin_async_save"):
        # Two saves, the second timed, as `cairn bench` and torch_peer.py.
        saver = cairn.AsyncSaver() if kind == "cairn_async_save" else None
        for round_ in range(2):
            path = f"{spec['path']}-{round_}"
            dist.barrier()
            t0 = time.monotonic()
            if saver is not None:
                future = saver.save(state, path)
            else:
                future = dcp.async_save(
                    state, storage_writer=plugin.StorageWriter(path))
            t_blocked = time.monotonic()
            future.result()
            t1 = time.monotonic()
            if round_ == 0:
                out["first_t0"], out["first_t_blocked"], out["first_t1"] = (
                    t0, t_blocked, t1)
                dist.barrier()
                if rank == 0:  # only the second is kept
                    shutil.rmtree(path, ignore_errors=True)
        if saver is not None:
            out["staging_allocations"] = saver.staging_allocations
            saver.close()
        out["t_blocked"] = t_blocked
        out["peak_rss_bytes"] = tp.maxrss_bytes()
    elif kind in ("cairn_load", "plugin_load"):
        prepare_cache()
        dist.barrier()
        t0 = time.monotonic()
        if kind == "cairn_load":
            result = cairn.load(state, spec["path"])
        else:
            dcp.load(state, storage_reader=plugin.StorageReader(spec["path"]))
        t1 = time.monotonic()
        out["peak_rss_bytes"] = tp.maxrss_bytes()
        if kind == "cairn_load":
            out["storage_bytes_read"] = int(result.bytes_read)
            out.update(library_diagnostics(result, LOAD_PHASES))
        out["verified_bytes"] = verify_state(state, local, shapes,
                                             spec["name"])
        out["verified"] = True
    else:
        raise ValueError(f"unknown phase kind {kind}")
    out["t0"] = t0
    out["t1"] = t1
    dist.barrier()  # nobody leaves while the store on rank 0 may be needed
    return out


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------
def median_diagnostics(samples, med):
    """For the median sample: the slowest rank's library seconds and each
    phase's slowest rank (as `cairn bench` gives phase_seconds), and the
    Python side's share (seconds - library seconds, slowest rank)."""
    res = next(res for sec, res in samples if sec == med) \
        if med in [s for s, _ in samples] else samples[0][1]
    if not all("library_seconds" in r for r in res):
        return {}
    phases = {p: max(r["phase_seconds"][p] for r in res)
              for p in res[0]["phase_seconds"]}
    return {"library_seconds": max(r["library_seconds"] for r in res),
            "phase_seconds": phases,
            "python_overhead_seconds": max(
                (r["t1"] - r["t0"]) - r["library_seconds"] for r in res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model JSON from harness")
    ap.add_argument("--dir", required=True,
                    help="directory for checkpoints (a fresh subdirectory "
                         "is created and removed)")
    ap.add_argument("--ranks", type=int, default=4, help="save ranks W")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cold", choices=["auto", "drop", "none"],
                    default="auto")
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--only", help="comma list of row names to run")
    ap.add_argument("--no-plugin", action="store_true",
                    help="leave out the cairn.torch (DCP plugin) rows")
    ap.add_argument("--keep", action="store_true",
                    help="keep checkpoint directories")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds allowed per phase run (all ranks)")
    args = ap.parse_args()
    if args.ranks < 1 or args.repeat < 1:
        ap.error("--ranks and --repeat must be >= 1")
    if args.out and not os.path.isdir(
            os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out {args.out}: its directory does not exist")
    if not os.path.isfile(args.model):
        ap.error(f"--model {args.model}: no such file")

    import torch
    import torch.multiprocessing as tmp

    import cairn
    tensors, total = tp.load_model(args.model)
    W = args.ranks
    targets = [("load_same", W, 0)]
    for w2 in sorted({W // 2, W - 1} - {0, W}):
        targets.append((f"load_{W}to{w2}_rows", w2, 0))
        targets.append((f"load_{W}to{w2}_cols", w2, 1))
    api_rows = ["save_sync", "async_save"] + [t[0] for t in targets]
    all_rows = api_rows + ["plugin_" + n for n in api_rows]
    selected = set(all_rows)
    if args.only:
        selected = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = selected - set(all_rows)
        if unknown:
            ap.error(f"unknown row(s) {sorted(unknown)}; known: "
                     f"{', '.join(all_rows)}")

    notes = []
    plugin_reason = None
    if args.no_plugin:
        plugin_reason = "--no-plugin given"
    else:
        _, plugin_reason = plugin_module()
    if plugin_reason:
        selected -= {n for n in selected if n.startswith("plugin_")}
        notes.append(f"plugin rows not measured: {plugin_reason}")

    if args.cold == "none":
        cold_method = "unavailable"
        notes.append("cold rows skipped: --cold none")
    elif os.geteuid() == 0 and os.access(tp.DROP_CACHES, os.W_OK):
        cold_method = "drop_caches"
    elif args.cold == "drop":
        raise SystemExit(f"--cold drop: cannot write {tp.DROP_CACHES} "
                         f"(need root)")
    else:
        cold_method = "unavailable"
        notes.append(f"cold rows skipped: {tp.DROP_CACHES} not writable")
    caches = (["cold"] if cold_method == "drop_caches" else []) + ["warm"]

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(os.path.abspath(args.dir),
                        f"cairn_py_peer_{os.getpid()}_{int(time.time())}")
    os.makedirs(work)
    ctx = tmp.get_context("spawn")
    base = {"tensors": tensors, "timeout": args.timeout}
    results = []
    log(f"cairn {cairn.__version__} (Python API), torch {torch.__version__}, "
        f"{len(tensors)} tensors, {total} bytes ({total / 2**20:.1f} MiB), "
        f"{W} save ranks, cold={cold_method}, plugin="
        f"{'no: ' + plugin_reason if plugin_reason else 'yes'}, work {work}")

    def one_sample(spec, world):
        os.sync()  # no earlier dirty data flushes inside a timer
        res = tp.run_workers(spec, world, args.timeout, body=rank_body,
                             ctx=ctx)
        sec = max(r["t1"] for r in res) - min(r["t0"] for r in res)
        return sec, res

    def record(name, kind, world, samples, extra):
        secs = [s for s, _ in samples]
        med = statistics.median(secs)
        every = [r for _, res in samples for r in res]
        row = {"name": name, "kind": kind}
        row.update(extra)
        row.update({
            "seconds": med,
            "gb_per_s": total / med / 1e9 if med > 0 else None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in every),
            "baseline_rss_bytes": max(r["baseline_rss_bytes"]
                                      for r in every),
            "dest_bytes": max(r["dest_bytes"] for r in every),
            "peak_rss_over_dest_bytes": max(
                r["peak_rss_bytes"] - r["dest_bytes"] for r in every),
            "ranks": world, "samples": secs,
            **median_diagnostics(samples, med),
            "rank_seconds": [[r["t1"] - r["t0"] for r in res]
                             for _, res in samples]})
        results.append(row)

    def run_save(name, kind, path, report):
        samples = []
        for i in range(args.repeat if report else 1):
            tp.remove(path)
            sec, res = one_sample(dict(base, name=name, kind=kind, path=path),
                                  W)
            samples.append((sec, res))
            log(f"{name} {i + 1}/{args.repeat}: {sec:.3f} s "
                f"{total / sec / 1e9:.3f} GB/s"
                + ("" if report else " (prerequisite)"))
        if report:
            disk, nfiles = tp.dir_bytes(path)
            record(name, "save", W, samples,
                   {"disk_bytes": disk, "files": nfiles})

    def run_async(name, kind, path):
        samples = []
        for i in range(args.repeat):
            sec, res = one_sample(dict(base, name=name, kind=kind, path=path),
                                  W)
            blocked = (max(r["t_blocked"] for r in res)
                       - min(r["t0"] for r in res))
            samples.append((sec, res, blocked))
            log(f"{name} {i + 1}/{args.repeat}: blocked {blocked:.3f} s, "
                f"done {sec:.3f} s")
            for k in range(2):
                tp.remove(f"{path}-{k}")
        first = samples[0][1]
        record(name, "async", W, [(s, r) for s, r, _ in samples], {
            "blocked_seconds": statistics.median(b for _, _, b in samples),
            "blocked_samples": [b for _, _, b in samples],
            "first_call_blocked_seconds": (
                max(r["first_t_blocked"] for r in first)
                - min(r["first_t0"] for r in first)),
            "first_call_seconds": (max(r["first_t1"] for r in first)
                                   - min(r["first_t0"] for r in first))})

    def run_load(name, kind, path, world, split_dim):
        per_cache = {c: [] for c in caches}
        for i in range(args.repeat):
            for cache in caches:  # cold first, then warm right after
                spec = dict(base, name=name, kind=kind, path=path,
                            cache=cache, split_dim=split_dim,
                            drop=cold_method == "drop_caches")
                sec, res = one_sample(spec, world)
                if not all(r.get("verified") for r in res):
                    raise tp.PhaseError(f"{name} {cache}: not verified")
                per_cache[cache].append((sec, res))
                log(f"{name} {cache} {i + 1}/{args.repeat}: {sec:.3f} s "
                    f"{total / sec / 1e9:.3f} GB/s, verified")
        for cache in caches:
            extra = {"cache": cache, "verified": True, "save_ranks": W,
                     "split": "rows" if split_dim == 0 else "cols"}
            reads = [sum(r.get("storage_bytes_read", 0) for r in res)
                     for _, res in per_cache[cache]]
            if any(reads):
                extra["storage_bytes_read"] = max(reads)
            record(name, "load", world, per_cache[cache], extra)

    exit_code = 0
    try:
        for prefix, save_kind, async_kind, load_kind in (
                ("", "cairn_save", "cairn_async_save", "cairn_load"),
                ("plugin_", "plugin_save", "plugin_async_save",
                 "plugin_load")):
            rows = [n for n in api_rows if prefix + n in selected]
            if not rows:
                continue
            ckpt = os.path.join(work, (prefix or "api_") + "ckpt")
            loads = [t for t in targets if t[0] in rows]
            if "save_sync" in rows or loads:
                run_save(prefix + "save_sync", save_kind, ckpt,
                         "save_sync" in rows)
            if "async_save" in rows:
                run_async(prefix + "async_save", async_kind,
                          os.path.join(work, prefix + "async"))
            for name, w2, d in loads:
                run_load(prefix + name, load_kind, ckpt, w2, d)
            if not args.keep:
                tp.remove(ckpt)
    except tp.PhaseError as e:
        log(f"FAILED: {e}")
        exit_code = 1
    except KeyboardInterrupt:
        log("interrupted")
        exit_code = 130
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")
    if exit_code:
        sys.exit(exit_code)

    notes += [
        "Rows are named as cairn bench's (save_sync, async_save, load_*); "
        "plugin_* rows are the same through torch.distributed.checkpoint "
        "with cairn.torch.StorageWriter/StorageReader.",
        "seconds = the last rank's end minus the first rank's start after a "
        "barrier (CLOCK_MONOTONIC); median over --repeat samples, each in "
        "fresh processes. GB/s = state bytes / seconds / 1e9 on every row.",
        "Ranks: torch.multiprocessing spawn processes, gloo on 127.0.0.1; "
        "cairn's calls take comm=None (cairn's own gloo group, made before "
        "the timer); each process runs cpus // W torch threads.",
        "State: DTensors on a 1-D CPU mesh, Shard(0) for saves and for row "
        "loads, Shard(1) for column loads (1-D tensors Shard(0)), 0-d "
        "tensors plain; destinations allocated by torch and filled with "
        "NaN before the timer; every element checked after it.",
        "async_save: the second of two saves on one AsyncSaver (or "
        "dcp.async_save) is timed: blocked until save() returned, seconds "
        "until the future's result() returned.",
        "cold: sync + drop_caches before the timer; warm: caches dropped, "
        "then the checkpoint read twice before the timer.",
    ]
    report = {
        "peer": "cairn_py",
        "cairn_version": cairn.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "bytes": total, "tensors": len(tensors), "ranks": W,
        "repeat": args.repeat, "cold_method": cold_method,
        "cpus": os.cpu_count(),
        "plugin_not_measured": plugin_reason,
        "results": results, "notes": notes,
    }
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(args.out + ".tmp", args.out)
        log(f"wrote {args.out}")
    print(f"cairn Python API: {total} bytes, cold={cold_method}, "
          f"repeat={args.repeat}")
    for r in results:
        print(f"{r['name']:<28} {r.get('cache', '-'):<5} {r['ranks']:>3} "
              f"{r['seconds']:>9.3f} s"
              + (f"  blocked {r['blocked_seconds']:.3f} s"
                 if "blocked_seconds" in r else ""))


if __name__ == "__main__":
    main()
