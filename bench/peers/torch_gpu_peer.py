#!/usr/bin/env python3
"""PyTorch peer for cairn_gpu_bench: the same tensors on one GPU, saved and
loaded by torch.save/torch.load and by torch.distributed.checkpoint (save,
async_save, load), one process, files fsynced.

Usage (on a machine with a GPU and PyTorch 2.x):
  python3 bench/peers/torch_gpu_peer.py --model MODEL.json --dir DIR \
      [--out RESULT.json] [--cold auto|none]

MODEL.json is what `cairn_gpu_bench --model-out` writes:
{"bytes": N, "tensors": [{"fqn": ..., "shape": [...], "dtype": "float32"}]}.
Rows (name, cache) pair with cairn_gpu_bench's: save_sync, async_save,
load_same cold/warm.
"""

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import time

DROP_CACHES = "/proc/sys/vm/drop_caches"


def log(msg):
    print(f"[torch_gpu_peer {time.strftime('%H:%M:%S')}] {msg}",
          file=sys.stderr, flush=True)


def drop_caches():
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def prewarm(path):
    buf = bytearray(8 << 20)
    for root, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(root, n), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def fsync_tree(path):
    for root, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    ap.add_argument("--cold", choices=["auto", "none"], default="auto")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with open(args.model) as f:
        model = json.load(f)
    total = int(model["bytes"])
    dev = torch.device("cuda", 0)
    # One process group of one rank (gloo): async_save needs one.
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    state = {}
    for t in model["tensors"]:
        state[t["fqn"]] = torch.randn(t["shape"], device=dev,
                                      dtype=torch.float32, generator=gen)
    reference = {k: v.clone() for k, v in state.items()}
    torch.cuda.synchronize()
    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(args.dir, f"torch_gpu_peer_{os.getpid()}")
    os.makedirs(work)
    results = []
    notes = [f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
             "one process, one GPU"]

    def row(name, kind, cache, seconds, **extra):
        r = {"name": name, "kind": kind, "cache": cache, "seconds": seconds,
             "gb_per_s": total / seconds / 1e9,
             "peak_rss_bytes": resource.getrusage(
                 resource.RUSAGE_SELF).ru_maxrss * 1024}
        r.update(extra)
        results.append(r)
        log(f"{name:<22} {cache or '':<5} {seconds:8.3f} s "
            f"{total / seconds / 1e9:7.2f} GB/s {extra or ''}")

    def check(loaded, what):
        for k, v in reference.items():
            if not torch.equal(loaded[k], v):
                raise SystemExit(f"VERIFY FAILED {what}: {k}")

    # torch.save / torch.load of the device tensors.
    path = os.path.join(work, "torch_save.pt")
    os.sync()
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_tree(work)
    row("torch_save", "save", None, time.perf_counter() - t0)
    can_drop = args.cold != "none" and drop_caches()
    caches = (["cold"] if can_drop else []) + ["warm"]
    if not can_drop:
        notes.append("cold rows skipped: cannot drop the page cache")
    for cache in caches:
        drop_caches() if cache == "cold" else prewarm(work)
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location=dev)
        torch.cuda.synchronize()
        row("torch_load", "load", cache, time.perf_counter() - t0)
        check(loaded, "torch_load")
        del loaded
    os.remove(path)

    # DCP save (sync_files is on by default in FileSystemWriter).
    dcp_dir = os.path.join(work, "dcp")
    os.sync()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=dcp_dir)
    row("dcp_save", "save", None, time.perf_counter() - t0)

    # DCP async_save: blocked until it returns, total until the future is
    # done. Twice: the first allocates its staging memory.
    for i, name in enumerate(["dcp_async_save_first", "dcp_async_save"]):
        adir = os.path.join(work, f"dcp_async_{i}")
        os.sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=adir)
        blocked = time.perf_counter() - t0
        if hasattr(fut, "staging_completion"):  # AsyncSaveResponse (newer)
            fut = fut.upload_completion
        fut.result()
        row(name, "async", None, time.perf_counter() - t0,
            blocked_seconds=blocked)
        shutil.rmtree(adir)

    # DCP load into device tensors.
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    for cache in caches:
        for v in dest.values():
            v.zero_()
        torch.cuda.synchronize()
        drop_caches() if cache == "cold" else prewarm(dcp_dir)
        t0 = time.perf_counter()
        dcp.load(dest, checkpoint_id=dcp_dir)
        torch.cuda.synchronize()
        row("dcp_load_same", "load", cache, time.perf_counter() - t0)
        check(dest, "dcp_load")

    shutil.rmtree(work)
    out = {"peer": "torch_gpu", "torch_version": torch.__version__,
           "device": torch.cuda.get_device_name(0), "bytes": total,
           "results": results, "notes": notes}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
