#!/usr/bin/env python3
"""PyTorch peer benchmark for cairn's benchmark harness.

Measures, on the tensors described by a model JSON written by the harness:

  torch_save / torch_load   one process, a full state dict of plain tensors,
                            torch.save + fsync(file) + fsync(dir) / torch.load
  dcp_save_*                distributed checkpoint (torch 1.13's
                            torch.distributed._shard.checkpoint, or
                            torch.distributed.checkpoint.save on 2.x), W
                            ranks as processes over gloo on 127.0.0.1 with
                            cpus // W torch threads each, ShardedTensors
                            split on dim 0; single_file_per_rank True / False
  dcp_async_save            torch 2.x only: async_save twice, the second
                            timed (blocked, and until its future is done)
  dcp_load_*                loads of the single_file_per_rank checkpoint into
                            the same layout and resharded (W -> W' ranks, row
                            or column split), cold and warm page cache

Every phase runs in fresh worker processes so that each phase's peak RSS is
its own. Every load is checked element by element against the values that
were saved; a wrong byte makes the script fail.

Usage:
  /usr/bin/python3 bench/peers/torch_peer.py --model MODEL.json --dir DIR \
      [--ranks 4] [--repeat 1] [--cold auto|drop|none] [--out RESULT.json] \
      [--only LIST] [--keep] [--timeout SECONDS]

Only the Python standard library and torch are used.
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import queue
import resource
import shutil
import socket
import statistics
import sys
import time
import traceback
import zlib

DROP_CACHES = "/proc/sys/vm/drop_caches"
GEN_CHUNK_ELEMS = 1 << 22  # elements generated per step (bounds temporaries)


def log(msg):
    print(f"[torch_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


# --------------------------------------------------------------------------
# torch 1.13 on Python 3.11: torch.distributed._shard fails to import because
# sharded_tensor/metadata.py declares a dataclass field whose default is a
# dataclass instance (mutable default, rejected since Python 3.11). Apply the
# same remedy as upstream (default_factory) in memory only: while the module
# is first imported, dataclasses.field turns such a default into a factory
# that returns a fresh copy. Nothing installed is modified.
# --------------------------------------------------------------------------
_DCP_IMPORTED = False


def import_dcp():
    global _DCP_IMPORTED
    if _DCP_IMPORTED:
        return
    original_field = dataclasses.field

    def patched_field(*args, **kwargs):
        default = kwargs.get("default", dataclasses.MISSING)
        if (default is not dataclasses.MISSING
                and dataclasses.is_dataclass(default)
                and not isinstance(default, type)
                and type(default).__hash__ is None):
            del kwargs["default"]
            kwargs["default_factory"] = (
                lambda proto=default: dataclasses.replace(proto))
        return original_field(*args, **kwargs)

    dataclasses.field = patched_field
    try:
        import torch.distributed._shard.sharded_tensor  # noqa: F401
        # torch 2.x keeps _shard.checkpoint only as an alias that warns
        # with "always" on import: import it only where it is the DCP.
        if modern_dcp() is None:
            import torch.distributed._shard.checkpoint  # noqa: F401
    finally:
        dataclasses.field = original_field
    _DCP_IMPORTED = True


def modern_dcp():
    """torch.distributed.checkpoint where it has save() and load() (torch 2.2
    and later), else None (torch 1.13 has only _shard.checkpoint)."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    return dcp if hasattr(dcp, "save") and hasattr(dcp, "load") else None


def dcp_functions():
    """(FileSystemWriter, save, FileSystemReader, load) of the DCP this torch
    has: modern_dcp()'s save/load, else torch 1.13's save_state_dict and
    load_state_dict. Both take state_dict= and storage_writer=/_reader=."""
    import_dcp()
    dcp = modern_dcp()
    if dcp is not None:
        return dcp.FileSystemWriter, dcp.save, dcp.FileSystemReader, dcp.load
    from torch.distributed._shard.checkpoint import (
        FileSystemReader, FileSystemWriter, load_state_dict, save_state_dict)
    return FileSystemWriter, save_state_dict, FileSystemReader, load_state_dict


def dcp_api_name():
    import_dcp()
    if modern_dcp() is not None:
        return "torch.distributed.checkpoint.save/load"
    return "torch.distributed._shard.checkpoint.save_state_dict/load_state_dict"


# --------------------------------------------------------------------------
# Deterministic tensor contents: element with flat index i of tensor `fqn`
# holds ((i + seed(fqn)) * K mod 2^24 - 2^23) / 1024, exactly representable
# in float32. Any block of any tensor can be regenerated independently, so
# ranks only build their own rows and loads can be checked exactly.
# --------------------------------------------------------------------------
def fqn_seed(fqn):
    return zlib.crc32(fqn.encode("utf-8")) & 0x0FFFFFFF


def row_major_strides(shape):
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def fill_block(out, fqn, shape, starts):
    """Writes into `out` the block of tensor `fqn` (global `shape`) whose
    first element is at multi-index `starts`; out.shape is the block size."""
    import torch
    if out.numel() == 0:
        return out
    seed = fqn_seed(fqn)
    if out.dim() == 0:
        v = ((seed & 0x7FFFFFFF) * 2654435761) & 0xFFFFFF
        out.fill_(float(v - (1 << 23)) / 1024.0)
        return out
    strides = row_major_strides(shape)
    lengths = list(out.shape)
    inner = 1
    for n in lengths[1:]:
        inner *= n
    # Offset of each element of one dim-0 slice of the block.
    base = torch.zeros([1] * (len(lengths) - 1), dtype=torch.int64)
    for d in range(1, len(lengths)):
        view = [1] * (len(lengths) - 1)
        view[d - 1] = lengths[d]
        base = base + (torch.arange(starts[d], starts[d] + lengths[d],
                                    dtype=torch.int64) * strides[d]).view(view)
    base = base.reshape(-1)
    rows_per_step = max(1, GEN_CHUNK_ELEMS // max(1, inner))
    flat_out = out.view(lengths[0], inner)
    for r0 in range(0, lengths[0], rows_per_step):
        r1 = min(lengths[0], r0 + rows_per_step)
        rows = torch.arange(starts[0] + r0, starts[0] + r1,
                            dtype=torch.int64) * strides[0]
        idx = rows.view(-1, 1) + base.view(1, -1) + seed
        idx.bitwise_and_(0x7FFFFFFF)
        idx.mul_(2654435761)
        idx.bitwise_and_(0xFFFFFF)
        idx.sub_(1 << 23)
        flat_out[r0:r1].copy_(idx.to(torch.float32).mul_(1.0 / 1024.0))
    return out


def make_block(fqn, shape, starts, lengths):
    import torch
    out = torch.empty(lengths, dtype=torch.float32)
    return fill_block(out, fqn, shape, starts)


def check_block(actual, fqn, shape, starts, what):
    expected = make_block(fqn, shape, starts, list(actual.shape))
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise RuntimeError(
            f"VERIFY FAILED {what}: {fqn} block at {starts}: got "
            f"{actual.dtype} {list(actual.shape)}, expected "
            f"{expected.dtype} {list(expected.shape)}")
    if not bool((actual == expected).all()):
        bad = int((actual != expected).sum())
        first = (actual != expected).nonzero()[0].tolist()
        raise RuntimeError(
            f"VERIFY FAILED {what}: {fqn} block at offsets {starts} size "
            f"{list(actual.shape)}: {bad} of {actual.numel()} elements differ "
            f"(first at local index {first}: got "
            f"{actual[tuple(first)].item()}, expected "
            f"{expected[tuple(first)].item()})")


def part(n, k, world):
    """Rows [lo, hi) that rank k of `world` holds along a dim of size n."""
    return n * k // world, n * (k + 1) // world


# --------------------------------------------------------------------------
# Worker side (runs in fresh spawned processes)
# --------------------------------------------------------------------------
def maxrss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drop_caches():
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def prewarm(path, drop):
    """Reads every file under `path` (or the file `path`) twice, so that the
    following timed read finds it in the page cache and on the kernel's
    active list (a page read a second time moves there), whatever the load
    before did; with `drop`, the page cache is dropped first. As cairn
    bench's warm rows (tools/bench.cc, Prewarm)."""
    if drop:
        drop_caches()
    files = []
    if os.path.isdir(path):
        for root, _, names in os.walk(path):
            files += [os.path.join(root, n) for n in names]
    else:
        files.append(path)
    buf = bytearray(8 << 20)
    for _ in range(2):
        for fn in files:
            with open(fn, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_sharded_state(spec, rank, world, split_dim, fill):
    """State dict of ShardedTensors; this rank holds part `rank` of `world`
    along `split_dim` (dim 0 for 1-D tensors). fill: 'data' (the saved
    values) or 'nan' (destination buffers, touched before any timer)."""
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard, init_from_local_shards)
    state = {}
    local = {}
    for t in spec["tensors"]:
        fqn, shape = t["fqn"], t["shape"]
        if len(shape) == 0:  # scalars: a plain (replicated) tensor
            buf = torch.empty([], dtype=torch.float32)
            if fill == "data":
                fill_block(buf, fqn, shape, [])
            else:
                buf.fill_(float("nan"))
            state[fqn] = buf
            local[fqn] = [([], buf)]
            continue
        d = split_dim if len(shape) > 1 else 0
        lo, hi = part(shape[d], rank, world)
        shards = []
        local[fqn] = []
        if hi > lo:
            offsets = [0] * len(shape)
            offsets[d] = lo
            sizes = list(shape)
            sizes[d] = hi - lo
            buf = torch.empty(sizes, dtype=torch.float32)
            if fill == "data":
                fill_block(buf, fqn, shape, offsets)
            else:
                buf.fill_(float("nan"))
            md = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes,
                               placement=f"rank:{rank}/cpu")
            shards.append(Shard(tensor=buf, metadata=md))
            local[fqn].append((offsets, buf))
        state[fqn] = init_from_local_shards(shards, *shape)
    return state, local


def state_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def local_bytes(local):
    """Bytes of the shards this rank holds, from build_sharded_state."""
    return state_bytes(buf for blocks in local.values() for _, buf in blocks)


def rank_body(spec, rank, world, port):
    import torch
    kind = spec["kind"]
    out = {"rank": rank}
    dist = None
    if kind in ("dcp_save", "dcp_async_save", "dcp_load"):
        import datetime
        import_dcp()
        import torch.distributed as dist
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=spec["timeout"]))
    # Each of the `world` processes gets its share of the cores for torch's
    # intra-op threads, as under torchrun (which goes further and sets
    # OMP_NUM_THREADS=1). torch's default, every core in every process,
    # oversubscribes a many-core machine: on 16 cores (2026-11-24, H200
    # machine) DCP loads on 3 and 4 ranks took 4-8 s cold or warm, on 2
    # ranks 0.7-1.5 s.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out["baseline_rss_bytes"] = maxrss_bytes()
    out["torch_threads"] = torch.get_num_threads()

    def sync_point():
        if dist is not None:
            dist.barrier()

    def prepare_cache():
        # Outside every timer. Cold: flush and drop the page cache. Warm:
        # make sure the checkpoint is in the page cache.
        sync_point()
        if rank == 0:
            if spec.get("cache") == "cold":
                drop_caches()
            elif spec.get("cache") == "warm":
                prewarm(spec["path"], spec.get("drop", False))
        sync_point()

    if kind == "torch_save":
        state = {}
        for t in spec["tensors"]:
            state[t["fqn"]] = make_block(t["fqn"], t["shape"],
                                         [0] * len(t["shape"]), t["shape"])
        out["dest_bytes"] = state_bytes(state.values())
        t0 = time.monotonic()
        with open(spec["path"], "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(os.path.dirname(spec["path"]))
        t1 = time.monotonic()
        out["peak_rss_bytes"] = maxrss_bytes()
    elif kind == "torch_load":
        prepare_cache()
        t0 = time.monotonic()
        state = torch.load(spec["path"], map_location="cpu")
        t1 = time.monotonic()
        out["peak_rss_bytes"] = maxrss_bytes()
        out["dest_bytes"] = state_bytes(state.values())
        names = [t["fqn"] for t in spec["tensors"]]
        if sorted(state.keys()) != sorted(names):
            raise RuntimeError("VERIFY FAILED torch_load: key set differs")
        for t in spec["tensors"]:
            check_block(state[t["fqn"]], t["fqn"], t["shape"],
                        [0] * len(t["shape"]), "torch_load")
            state[t["fqn"]] = None
        out["verified"] = True
    elif kind == "dcp_save":
        FileSystemWriter, save, _, _ = dcp_functions()
        state, local = build_sharded_state(spec, rank, world, 0, "data")
        out["dest_bytes"] = local_bytes(local)
        sync_point()
        t0 = time.monotonic()
        save(state_dict=state,
             storage_writer=FileSystemWriter(
                 spec["path"],
                 single_file_per_rank=spec["single_file_per_rank"],
                 sync_files=True))
        if rank == 0:
            fsync_dir(spec["path"])
        t1 = time.monotonic()
        out["peak_rss_bytes"] = maxrss_bytes()
    elif kind == "dcp_async_save":
        # torch 2.x: two async saves of the same state, as cairn's async
        # phase does; the second (after the first has set up whatever it
        # reuses) is timed. t_blocked: when async_save returned; t1: when
        # its future was done and the directory fsynced.
        FileSystemWriter = modern_dcp().FileSystemWriter
        state, local = build_sharded_state(spec, rank, world, 0, "data")
        out["dest_bytes"] = local_bytes(local)
        for round_ in range(2):
            path = f"{spec['path']}-{round_}"
            sync_point()
            t0 = time.monotonic()
            future = modern_dcp().async_save(
                state_dict=state,
                storage_writer=FileSystemWriter(
                    path, single_file_per_rank=True, sync_files=True))
            t_blocked = time.monotonic()
            future.result()
            sync_point()  # every rank's part written before the fsync
            if rank == 0:
                fsync_dir(path)
            t1 = time.monotonic()
            if round_ == 0:
                out["first_t0"], out["first_t_blocked"], out["first_t1"] = (
                    t0, t_blocked, t1)
        out["t_blocked"] = t_blocked
        out["peak_rss_bytes"] = maxrss_bytes()
    elif kind == "dcp_load":
        _, _, FileSystemReader, load = dcp_functions()
        state, local = build_sharded_state(spec, rank, world,
                                           spec["split_dim"], "nan")
        out["dest_bytes"] = local_bytes(local)
        prepare_cache()
        t0 = time.monotonic()
        load(state_dict=state, storage_reader=FileSystemReader(spec["path"]))
        t1 = time.monotonic()
        out["peak_rss_bytes"] = maxrss_bytes()
        shapes = {t["fqn"]: t["shape"] for t in spec["tensors"]}
        checked = 0
        for fqn, blocks in local.items():
            obj = state[fqn]
            if hasattr(obj, "local_shards"):
                got = [(s.metadata.shard_offsets, s.tensor)
                       for s in obj.local_shards()]
            else:
                got = [([], obj)]
            if len(got) != len(blocks):
                raise RuntimeError(
                    f"VERIFY FAILED {spec['name']}: {fqn} has {len(got)} "
                    f"local shards after load, expected {len(blocks)}")
            for (offs, buf), (goffs, gbuf) in zip(blocks, got):
                if list(offs) != list(goffs) or (
                        buf.numel() and buf.data_ptr() != gbuf.data_ptr()):
                    raise RuntimeError(
                        f"VERIFY FAILED {spec['name']}: {fqn} shard moved "
                        f"or replaced during load")
                check_block(gbuf, fqn, shapes[fqn], list(offs), spec["name"])
                checked += gbuf.numel() * 4
        out["verified"] = True
        out["verified_bytes"] = checked
    else:
        raise ValueError(f"unknown phase kind {kind}")
    out["t0"] = t0
    out["t1"] = t1
    sync_point()  # nobody leaves while the store on rank 0 may be needed
    return out


def quiet_deprecations():
    """torch 2.x warns, once per rank and call, that ShardedTensor and
    torch.distributed._shard are deprecated; the peer uses them on purpose
    (the one API both 1.13 and 2.x have), so those lines only hide the
    progress."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=".*ShardedTensor.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning,
                            message=".*torch.distributed._shard.*")


def rank_main(spec, rank, world, port, q, body=None):
    """A worker process: runs `body` (default rank_body; another peer
    script passes its own) and reports to the parent over `q`."""
    quiet_deprecations()
    try:
        res = (body or rank_body)(spec, rank, world, port)
        q.put(("ok", rank, res))
        code = 0
    except BaseException:
        q.put(("err", rank, traceback.format_exc()))
        code = 1
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip slow/fragile teardown of gloo and the store


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------
class PhaseError(RuntimeError):
    pass


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def run_workers(spec, world, timeout, body=None, ctx=None):
    """Runs `body` (default rank_body) on `world` fresh processes of `ctx`
    (default: multiprocessing's spawn); returns their results or raises
    PhaseError (after killing every rank) on any failure/timeout."""
    ctx = ctx or multiprocessing.get_context("spawn")
    for attempt in range(3):
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main,
                             args=(spec, r, world, port, q, body),
                             daemon=True, name=f"{spec['name']}-rank{r}")
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        error = None
        deadline = time.monotonic() + timeout
        dead_since = None
        try:
            while len(results) < world and error is None:
                try:
                    status, rank, payload = q.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        error = (f"timed out after {timeout} s "
                                 f"({len(results)}/{world} ranks done)")
                        break
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode not in (None, 0)
                            and r not in results]
                    if dead:
                        # Give a dying rank's message a moment to arrive.
                        dead_since = dead_since or time.monotonic()
                        if time.monotonic() - dead_since > 3:
                            error = "; ".join(
                                f"rank {r} died with exit code "
                                f"{procs[r].exitcode} (signal/OOM?)"
                                for r in dead)
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    error = f"rank {rank} failed:\n{payload}"
        except KeyboardInterrupt:
            stop_all(procs)
            raise
        if error is None:
            for p in procs:
                p.join(30)
            stop_all(procs)
            return [results[r] for r in range(world)]
        stop_all(procs)
        if "Address already in use" in error and attempt < 2:
            log(f"port {port} was taken, retrying")
            continue
        raise PhaseError(f"phase {spec['name']}: {error}")


def dir_bytes(path):
    total, count = 0, 0
    if os.path.isdir(path):
        for root, _, names in os.walk(path):
            for n in names:
                total += os.path.getsize(os.path.join(root, n))
                count += 1
    elif os.path.exists(path):
        total, count = os.path.getsize(path), 1
    return total, count


def remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def load_model(path):
    with open(path) as f:
        model = json.load(f)
    tensors = []
    seen = set()
    total = 0
    for t in model["tensors"]:
        fqn = t["fqn"]
        shape = [int(x) for x in t["shape"]]
        dtype = t.get("dtype", "float32")
        if dtype not in ("float32", "f32", "torch.float32"):
            raise SystemExit(f"{path}: {fqn}: dtype {dtype} unsupported "
                             f"(only float32)")
        if fqn in seen:
            raise SystemExit(f"{path}: duplicate fqn {fqn}")
        if any(x < 0 for x in shape):
            raise SystemExit(f"{path}: {fqn}: bad shape {shape}")
        numel = 1
        for x in shape:
            numel *= x
        if numel == 0:
            raise SystemExit(f"{path}: {fqn}: empty tensors unsupported")
        seen.add(fqn)
        total += 4 * numel
        tensors.append({"fqn": fqn, "shape": shape})
    if "bytes" in model and int(model["bytes"]) != total:
        raise SystemExit(f"{path}: \"bytes\" is {model['bytes']} but the "
                         f"tensors hold {total} float32 bytes")
    return tensors, total


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
    ap.add_argument("--only", help="comma list of phase names to run")
    ap.add_argument("--keep", action="store_true",
                    help="keep checkpoint directories")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds allowed per phase run (all ranks)")
    args = ap.parse_args()
    if args.ranks < 1 or args.repeat < 1:
        ap.error("--ranks and --repeat must be >= 1")
    # Checked now rather than after minutes of measuring.
    out_dir = os.path.dirname(os.path.abspath(args.out or "."))
    if args.out and not os.path.isdir(out_dir):
        ap.error(f"--out {args.out}: its directory does not exist")
    if not os.path.isfile(args.model):
        ap.error(f"--model {args.model}: no such file (write it with "
                 f"`cairn bench ... --model-out FILE`)")

    import torch
    quiet_deprecations()
    tensors, total = load_model(args.model)
    W = args.ranks

    # Load targets: same layout, W/2 and W-1 ranks, rows and columns.
    targets = [("dcp_load_same", W, 0)]
    for w2 in sorted({W // 2, W - 1} - {0, W}):
        targets.append((f"dcp_load_{W}to{w2}_rows", w2, 0))
        targets.append((f"dcp_load_{W}to{w2}_cols", w2, 1))
    all_phases = (["torch_save", "torch_load", "dcp_save_single_file_per_rank",
                   "dcp_save_file_per_tensor", "dcp_async_save"] +
                  [t[0] for t in targets])
    if args.only:
        selected = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in selected if s not in all_phases]
        if unknown:
            ap.error(f"unknown phase(s) {unknown}; known: "
                     f"{', '.join(all_phases)}")
        selected = set(selected)
    else:
        selected = set(all_phases)

    notes = []
    if args.cold == "none":
        cold_method = "unavailable"
        notes.append("cold rows skipped: --cold none")
    else:
        can_drop = os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)
        if can_drop:
            cold_method = "drop_caches"
        elif args.cold == "drop":
            raise SystemExit(f"--cold drop: cannot write {DROP_CACHES} "
                             f"(need root)")
        else:
            cold_method = "unavailable"
            notes.append(f"cold rows skipped: {DROP_CACHES} not writable")
    caches = (["cold"] if cold_method == "drop_caches" else []) + ["warm"]

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(os.path.abspath(args.dir),
                        f"torch_peer_{os.getpid()}_{int(time.time())}")
    os.makedirs(work)
    base = {"tensors": tensors, "timeout": args.timeout}
    results = []
    worker_threads = []
    threads_by_world = {}
    log(f"torch {torch.__version__}, {len(tensors)} tensors, {total} bytes "
        f"({total / 2**20:.1f} MiB), {W} save ranks, cold={cold_method}, "
        f"work dir {work}")

    def one_sample(spec, world):
        os.sync()  # no earlier dirty data flushes inside a timer
        res = run_workers(spec, world, args.timeout)
        worker_threads.append(res[0]["torch_threads"])
        threads_by_world[str(world)] = res[0]["torch_threads"]
        sec = max(r["t1"] for r in res) - min(r["t0"] for r in res)
        return sec, res

    def record(name, kind, world, samples, rss, extra):
        secs = [s for s, _ in samples]
        med = statistics.median(secs)
        row = {"name": name, "kind": kind}
        row.update(extra)
        row.update({
            "seconds": med,
            "gb_per_s": total / med / 1e9 if med > 0 else None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rss),
            "peak_rss_sum_bytes": max(
                sum(r["peak_rss_bytes"] for r in res) for _, res in samples),
            "baseline_rss_bytes": max(r["baseline_rss_bytes"] for r in rss),
            "dest_bytes": max(r["dest_bytes"] for r in rss),
            "peak_rss_over_dest_bytes": max(
                r["peak_rss_bytes"] - r["dest_bytes"] for r in rss),
            "ranks": world,
            "samples": secs,
            "rank_seconds": [
                [r["t1"] - r["t0"] for r in res] for _, res in samples],
        })
        results.append(row)
        return row

    def run_save(name, kind, path, world, extra_spec, report):
        samples = []
        for i in range(args.repeat if report else 1):
            remove(path)
            spec = dict(base, name=name, kind=kind, path=path, **extra_spec)
            sec, res = one_sample(spec, world)
            samples.append((sec, res))
            log(f"{name} {i + 1}/{args.repeat}: {sec:.3f} s "
                f"{total / sec / 1e9:.3f} GB/s" + ("" if report else
                                                    " (prerequisite)"))
        if report:
            disk, nfiles = dir_bytes(path)
            rss = [r for _, res in samples for r in res]
            record(name, "save", world, samples, rss,
                   {"disk_bytes": disk, "files": nfiles})

    def run_load(name, kind, path, world, extra_spec, extra_row):
        per_cache = {c: [] for c in caches}
        for i in range(args.repeat):
            for cache in caches:  # cold first, then warm right after
                spec = dict(base, name=name, kind=kind, path=path,
                            cache=cache,
                            drop=cold_method == "drop_caches", **extra_spec)
                sec, res = one_sample(spec, world)
                if not all(r.get("verified") for r in res):
                    raise PhaseError(f"{name} {cache}: not verified")
                per_cache[cache].append((sec, res))
                log(f"{name} {cache} {i + 1}/{args.repeat}: {sec:.3f} s "
                    f"{total / sec / 1e9:.3f} GB/s, verified")
        for cache in caches:
            samples = per_cache[cache]
            rss = [r for _, res in samples for r in res]
            row = dict(extra_row)
            row["cache"] = cache
            row["verified"] = True
            record(name, "load", world, samples, rss, row)

    def run_async(path, world):
        samples = []
        try:
            for i in range(args.repeat):
                spec = dict(base, name="dcp_async_save", kind="dcp_async_save",
                            path=path)
                sec, res = one_sample(spec, world)
                blocked = (max(r["t_blocked"] for r in res) -
                           min(r["t0"] for r in res))
                samples.append((sec, res, blocked))
                log(f"dcp_async_save {i + 1}/{args.repeat}: blocked "
                    f"{blocked:.3f} s, done {sec:.3f} s")
                for k in range(2):
                    remove(f"{path}-{k}")
        except PhaseError as e:
            log(f"dcp_async_save FAILED (noted, not fatal): {e}")
            notes.append(f"dcp_async_save failed: {str(e).splitlines()[0]}")
            return
        rss = [r for _, res, _ in samples for r in res]
        first = samples[0][1]
        record("dcp_async_save", "async", world,
               [(sec, res) for sec, res, _ in samples], rss, {
                   "blocked_seconds": statistics.median(
                       b for _, _, b in samples),
                   "first_call_blocked_seconds": (
                       max(r["first_t_blocked"] for r in first) -
                       min(r["first_t0"] for r in first)),
                   "first_call_seconds": (max(r["first_t1"] for r in first) -
                                          min(r["first_t0"] for r in first)),
               })

    torch_file = os.path.join(work, "torch_save", "state.pt")
    sfpr_dir = os.path.join(work, "dcp_single_file_per_rank")
    fpt_dir = os.path.join(work, "dcp_file_per_tensor")
    exit_code = 0
    try:
        # 1. torch.save / torch.load, one process.
        if selected & {"torch_save", "torch_load"}:
            os.makedirs(os.path.dirname(torch_file))
            run_save("torch_save", "torch_save", torch_file, 1, {},
                     "torch_save" in selected)
            if "torch_load" in selected:
                run_load("torch_load", "torch_load", torch_file, 1, {}, {})
            if not args.keep:
                remove(os.path.dirname(torch_file))
        # 2. DCP saves, W ranks.
        loads = [t for t in targets if t[0] in selected]
        if "dcp_save_single_file_per_rank" in selected or loads:
            run_save("dcp_save_single_file_per_rank", "dcp_save", sfpr_dir, W,
                     {"single_file_per_rank": True},
                     "dcp_save_single_file_per_rank" in selected)
        if "dcp_save_file_per_tensor" in selected:
            run_save("dcp_save_file_per_tensor", "dcp_save", fpt_dir, W,
                     {"single_file_per_rank": False}, True)
            if not args.keep:
                remove(fpt_dir)
        # 2b. DCP async_save (torch 2.x), W ranks; a failure here is noted,
        # not fatal: the other rows still run.
        if "dcp_async_save" in selected:
            dcp = modern_dcp()
            if dcp is None or not hasattr(dcp, "async_save"):
                notes.append("dcp_async_save: this torch's DCP has no "
                             "async_save")
            else:
                run_async(os.path.join(work, "dcp_async"), W)
        # 3. DCP loads of the single_file_per_rank checkpoint.
        for name, w2, d in loads:
            run_load(name, "dcp_load", sfpr_dir, w2,
                     {"split_dim": d},
                     {"save_ranks": W, "split": "rows" if d == 0 else "cols"})
    except PhaseError as e:
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
        "GB/s = total state bytes / seconds / 1e9, for every row (also "
        "resharded loads, which each read the whole state across ranks).",
        "seconds = wall time from a common barrier to the last rank "
        "finishing (max t1 - min t0 over ranks, CLOCK_MONOTONIC); per-rank "
        "durations in rank_seconds. Median over --repeat samples.",
        "Every phase runs in fresh processes; peak_rss_bytes is the max over "
        "ranks of ru_maxrss taken right after the timed call (before "
        "verification); baseline_rss_bytes is ru_maxrss after importing "
        "torch and joining the process group, before any tensor exists. "
        "dest_bytes is the largest over ranks of the tensor bytes one "
        "process holds by design (its shards; for torch_save/torch_load the "
        "whole state), and peak_rss_over_dest_bytes the largest over ranks "
        "and samples of that process's peak_rss_bytes - dest_bytes: the "
        "per-process overhead to compare with cairn's.",
        "torch_save: full state dict of plain tensors, torch.save to one "
        "file, flush + fsync(file) + fsync(dir), inside the timer.",
        "torch_load: torch.load(map_location='cpu') allocates its own "
        "tensors, so fresh-memory page faults are inside its timer.",
        f"dcp_save_*: {dcp_api_name()} with "
        "FileSystemWriter(sync_files=True), which fsyncs each data file and "
        "the .metadata file; DCP never fsyncs the directory, so rank 0 "
        "fsyncs the checkpoint directory after the save, inside the "
        "timer.",
        "dcp_load_*: destination ShardedTensors are allocated and filled with "
        "NaN before the timer, so fresh-memory page faults are not timed; "
        "every element is checked against the saved values after the timer.",
        f"Tensors are split on dim 0 for saves: rank k of W holds "
        f"[n*k//W, n*(k+1)//W); loads use the same formula on dim 0 (rows) or "
        f"dim 1 (cols, 1-D tensors fall back to dim 0), from the "
        f"single_file_per_rank checkpoint.",
        "cold: sync + echo 3 > /proc/sys/vm/drop_caches after setup, outside "
        "the timer; warm: the same load again right after, with the page "
        "cache dropped (where cold rows run) and the checkpoint files read "
        "twice before the timer, so they are cached and on the kernel's "
        "active list whatever the cold load did (as cairn bench).",
        f"Ranks are processes (spawn) with gloo on 127.0.0.1; "
        f"{os.cpu_count()} CPUs on this host; each of W processes runs "
        f"cpus // W torch threads (torch_threads_by_world).",
    ]
    report = {
        "peer": "torch",
        "torch_version": torch.__version__,
        "dcp_api": dcp_api_name(),
        "python_version": platform.python_version(),
        "bytes": total,
        "tensors": len(tensors),
        "ranks": W,
        "repeat": args.repeat,
        "cold_method": cold_method,
        "cpus": os.cpu_count(),
        "torch_threads": worker_threads[0] if worker_threads else None,
        "torch_threads_by_world": threads_by_world,
        "results": results,
        "notes": notes,
    }
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
        log(f"wrote {args.out}")
    print_table(report)


def print_table(report):
    print(f"torch {report['torch_version']} peer: {report['bytes']} bytes "
          f"({report['bytes'] / 2**20:.1f} MiB), {report['tensors']} tensors, "
          f"cold={report['cold_method']}, repeat={report['repeat']}")
    hdr = (f"{'phase':<32} {'cache':<5} {'ranks':>5} {'seconds':>9} "
           f"{'GB/s':>7} {'peak RSS MiB':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in report["results"]:
        gbs = f"{r['gb_per_s']:.3f}" if r["gb_per_s"] else "-"
        print(f"{r['name']:<32} {r.get('cache', '-'):<5} {r['ranks']:>5} "
              f"{r['seconds']:>9.3f} {gbs:>7} "
              f"{r['peak_rss_bytes'] / 2**20:>12.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
