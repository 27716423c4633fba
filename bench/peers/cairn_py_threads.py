"""cairn's Python API with ranks as threads of one process, beside the CLI.

`cairn bench` runs its ranks as threads of one process (in-process
communicator); cairn_py_peer.py runs the Python API the way a PyTorch job
does, one process per rank over gloo. The two differ in more than the
binding. This script measures the binding alone: the same rows as the CLI,
through `cairn.save` / `cairn.load` called from W Python threads with
`cairn.in_process(W)` communicators (the CLI's own), on the same tensors
split the same way (rank k of W holds [n*k//W, n*(k+1)//W) of dim 0, or
dim 1 for _cols; 1-D tensors dim 0).

    python3 bench/peers/cairn_py_threads.py --cairn build/tools/cairn \\
        --dir /var/tmp/cairn-bench --size 256MiB --repeat 3 --out out.json

Each of --rounds rounds runs `cairn bench` (save and load phases, --json;
it also writes the model), then the Python rows; then it prints each row's
Python seconds, CLI seconds (medians of the pooled samples) and CLI/Python
(the target is >= 0.9). Python rows:
destinations allocated and filled with NaN before the timer; cold = page
cache dropped after that, warm = dropped, then the files read twice (as
the CLI); seconds from a barrier before the call to the last thread's
return; every element checked after; the median of --rounds x --repeat samples, all
in this one process (the CLI runs each sample in a fresh one).
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer as tp  # noqa: E402  (fill_block, check_block, caches)

LOADS = [("load_same", None, 0), ("load_4to2_rows", 2, 0),
         ("load_4to2_cols", 2, 1)]


def rank_state(tensors, rank, world, split, fill):
    import torch

    import cairn
    state, local = {}, {}
    for t in tensors:
        fqn, shape = t["fqn"], t["shape"]
        d = split if len(shape) > 1 else 0
        lo, hi = tp.part(shape[d], rank, world)
        starts = [0] * len(shape)
        sizes = list(shape)
        starts[d], sizes[d] = lo, hi - lo
        buf = torch.empty(sizes, dtype=torch.float32)
        if fill == "data":
            tp.fill_block(buf, fqn, shape, starts)
        else:
            buf.fill_(float("nan"))
        state[fqn] = cairn.ShardedTensor(shape, [(starts, buf)] if buf.numel()
                                         else [])
        if not buf.numel():
            del state[fqn]  # this rank holds none of it
        local[fqn] = (starts, buf)
    return state, local


def run_ranks(world, body):
    """Runs body(rank, comm, barrier) on `world` threads; returns the wall
    seconds from the barrier to the last return."""
    import cairn
    comms = cairn.in_process(world)
    barrier = threading.Barrier(world)
    starts, ends, errors = [0.0] * world, [0.0] * world, []

    def one(r):
        try:
            def timer_start():
                barrier.wait()
                starts[r] = time.monotonic()
            body(r, comms[r], timer_start)
            ends[r] = time.monotonic()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(ends) - min(starts)


def python_rows(tensors, workdir, world, repeat, cold):
    import cairn
    rows = {}
    path = str(workdir / "py-ckpt")

    def save_sample():
        shutil.rmtree(path, ignore_errors=True)
        states = [rank_state(tensors, r, world, 0, "data")[0]
                  for r in range(world)]

        def body(r, comm, timer_start):
            timer_start()
            cairn.save(states[r], path, comm=comm)
        return run_ranks(world, body)

    rows["save_sync"] = [save_sample() for _ in range(repeat)]
    for name, ranks, split in LOADS:
        ranks = ranks or world
        for cache in (["cold"] if cold else []) + ["warm"]:
            samples = []
            for _ in range(repeat):
                made = [rank_state(tensors, r, ranks, split, "nan")
                        for r in range(ranks)]
                if cache == "cold":
                    tp.drop_caches()
                else:
                    tp.prewarm(path, cold)

                def body(r, comm, timer_start):
                    timer_start()
                    cairn.load(made[r][0], path, comm=comm)
                samples.append(run_ranks(ranks, body))
                shapes = {t["fqn"]: t["shape"] for t in tensors}
                for state, local in made:
                    for fqn, (starts, buf) in local.items():
                        if buf.numel():
                            tp.check_block(buf, fqn, shapes[fqn], starts, name)
            rows[f"{name}/{cache}"] = samples
    shutil.rmtree(path, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cairn", default="build/tools/cairn")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3,
                    help="samples per row per round, for each side")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of CLI rows then Python rows, pooled")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    workdir = pathlib.Path(args.dir) / f"cairn_py_threads_{os.getpid()}"
    workdir.mkdir(parents=True)
    # Rounds alternate the CLI and the Python rows, so that the VM's slow
    # and fast spells fall on both; each row's samples are pooled.
    cli_rows, py = {}, {}
    try:
        cold = os.geteuid() == 0
        model = workdir / "model.json"
        for _ in range(args.rounds):
            cli = subprocess.run(
                [args.cairn, "bench", "--dir", str(workdir), "--size",
                 args.size, "--ranks", str(args.ranks), "--repeat",
                 str(args.repeat), "--phases", "save,load", "--cold",
                 "drop" if cold else "none", "--json", "--model-out",
                 str(model)],
                check=True, capture_output=True, text=True)
            for r in json.loads(cli.stdout)["results"]:
                key = r["name"] + (f"/{r['cache']}" if r.get("cache") else "")
                cli_rows.setdefault(key, []).extend(r["samples"])
            tensors, total = tp.load_model(str(model))
            rows = python_rows(tensors, workdir, args.ranks, args.repeat, cold)
            for key, samples in rows.items():
                py.setdefault(key, []).extend(samples)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"size": args.size, "bytes": total, "ranks": args.ranks,
              "repeat": args.repeat, "rounds": args.rounds, "rows": {}}
    print(f"{'row':24} {'python s':>9} {'CLI s':>9} {'CLI/python':>10}")
    for key, samples in py.items():
        med = statistics.median(samples)
        cli_samples = cli_rows.get(key)
        row = {"python_seconds": med, "python_samples": samples,
               "cli_seconds": (statistics.median(cli_samples)
                               if cli_samples else None),
               "cli_samples": cli_samples}
        if row["cli_seconds"]:
            row["cli_over_python"] = row["cli_seconds"] / med
        report["rows"][key] = row
        ratio = row.get("cli_over_python")
        print(f"{key:24} {med:9.4f} {row['cli_seconds'] or float('nan'):9.4f} "
              f"{ratio if ratio else float('nan'):10.2f}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
