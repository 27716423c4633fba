"""The torch.distributed communicator (cairn._comm.TorchCommunicator) on
three real gloo processes: every collective returns every message whole,
whether it fits its slot, fills it exactly, or overflows it on some ranks
only (the overflow goes by send/recv or a second collective)."""

import os

import gloo_jobs

# Message sizes around the slots (SLOT is 4 KiB with an 8-byte length).
SLOT = 4 << 10
BSLOT = 64 << 10


def message(rank, size, salt):
    return bytes((rank * 31 + salt + i) % 251 for i in range(size))


CASES = [
    # per-rank sizes for gather / all_gather / scatter
    (0, 0, 0),
    (1, 0, 5),
    (SLOT - 8, SLOT - 9, SLOT - 7),
    (SLOT - 7, 10, 3 * SLOT),
    (5 * SLOT + 3, 5 * SLOT + 3, 5 * SLOT + 3),
]
BROADCASTS = [0, 7, BSLOT - 8, BSLOT - 7, 3 * BSLOT + 11]


def job(rank, world, port, out):
    gloo_jobs.init(rank, world, port)
    import torch.distributed as dist
    from cairn._comm import TorchCommunicator
    assert TorchCommunicator.SLOT == SLOT
    assert TorchCommunicator.BROADCAST_SLOT == BSLOT
    c = TorchCommunicator(dist.new_group(backend="gloo"))
    for salt, sizes in enumerate(CASES):
        for root in range(world):
            mine = message(rank, sizes[rank], salt)
            want = [message(r, sizes[r], salt) for r in range(world)]
            assert c.all_gather(mine) == want, (sizes, "all_gather")
            got = c.gather(mine, root)
            assert got == (want if rank == root else []), (sizes, root)
            # Scatter: rank r gets message(r, ...), as the root built them.
            got = c.scatter(want if rank == root else None, root)
            assert got == want[rank], (sizes, root, "scatter")
    for salt, size in enumerate(BROADCASTS):
        for root in range(world):
            data = message(root, size, salt)
            got = c.broadcast(data if rank == root else b"", root)
            assert got == data, (size, root, "broadcast")
    with open(os.path.join(out, f"ok-{rank}"), "w") as f:
        f.write("ok")
    dist.destroy_process_group()


def test_collectives_carry_every_size(tmp_path):
    world = 3
    gloo_jobs.run(job, world, tmp_path)
    for r in range(world):
        assert (tmp_path / f"ok-{r}").read_text() == "ok"
