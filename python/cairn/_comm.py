"""How the ranks of a Python job talk during a save or a load.

``comm`` arguments take:

- ``None``: in a job where ``torch.distributed`` is initialized, a gloo
  group of all its ranks that cairn creates (once, on first use; every
  rank must make that first call, as any collective); else this process
  alone.
- a ``torch.distributed`` process group: a gloo group over the same ranks
  (the group itself when it is already gloo's). cairn's messages never mix
  with the application's: they go over a group of their own.
- a ``cairn.Communicator``: ``cairn.mpi_world()`` under ``mpirun``, or
  ``cairn.local()``.
- any object with the methods of :class:`TorchCommunicator` (see
  python/src/py_communicator.h).
"""

import sys
import threading

import numpy as np

from . import _cairn

_lock = threading.Lock()
# One cairn communicator (over a gloo group of its own) per torch.distributed
# job and set of ranks it serves.
_torch_comms = {}


def local():
    """One rank: this process alone."""
    return _cairn.local_communicator()


def in_process(n, timeout_s=0.0):
    """`n` ranks as threads of this process: a list of n communicators,
    rank r's at index r, for n threads that each call save or load with
    their own (the C++ library's in-process ranks: tests, simulations,
    benchmarks of the binding itself). cairn releases the GIL while it
    works, so the ranks run in parallel."""
    return _cairn.in_process_communicators(n, timeout_s)


def mpi_world(timeout_s=0.0):
    """A communicator over MPI_COMM_WORLD (under mpirun). ``timeout_s``: how
    long a rank waits for the others in a collective (0: cairn's default,
    10 minutes)."""
    return _cairn.mpi_world_communicator(timeout_s)


def _dist():
    return sys.modules.get("torch.distributed")


def _torch_initialized():
    dist = _dist()
    return dist is not None and dist.is_available() and dist.is_initialized()


def _job():
    """Identifies the current torch.distributed job (a test may tear it
    down and start another in the same process)."""
    return id(_dist().distributed_c10d._get_default_group())


class TorchCommunicator:
    """cairn's collectives over a torch.distributed gloo group.

    Messages are bytes; each variable-size collective first exchanges the
    sizes, then the bytes padded to the largest. ``broadcast_into`` moves a
    large buffer in place without a copy (torch.frombuffer on cairn's
    memory).
    """

    def __init__(self, group):
        import torch
        import torch.distributed as dist
        self._torch = torch
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._ranks = dist.get_process_group_ranks(group)

    # Queried once by the C++ side.
    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def kind(self):
        return "torch-gloo"

    def _u8(self, data, size=None, prefix=b""):
        """`prefix` then `data` in a uint8 tensor of `size` bytes (default:
        their own), the rest zeros: one copy (metadata.json travels this
        way, and can be large)."""
        p = len(prefix)
        n = p + len(data)
        t = self._torch.empty(n if size is None else size,
                              dtype=self._torch.uint8)
        a = t.numpy()
        a[:p] = np.frombuffer(prefix, dtype=np.uint8)
        a[p:n] = np.frombuffer(data, dtype=np.uint8)
        a[n:] = 0
        return t

    def _largest(self, n):
        """The largest `n` of all ranks: one allreduce, which gloo runs in
        about a third of the time of an allgather of the sizes."""
        t = self._i64([n])
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._group)
        return int(t.item())

    @staticmethod
    def _unprefixed(t):
        """The payload of a tensor that _u8 filled with a length prefix."""
        a = t.numpy()
        n = int(a[:8].view(np.int64)[0])
        return a[8:8 + n].tobytes()

    def _i64(self, values):
        return self._torch.tensor(values, dtype=self._torch.int64)

    def barrier(self):
        self._dist.barrier(group=self._group)

    def broadcast(self, data, root):
        n = self._i64([len(data)])
        self._dist.broadcast(n, group=self._group, group_src=root)
        n = int(n.item())
        if n == 0:
            return b""
        buf = self._u8(data if self._rank == root else b"", n)
        self._dist.broadcast(buf, group=self._group, group_src=root)
        return buf.numpy().tobytes()

    # Variable-size messages: every rank learns the largest size (so all
    # pad alike), and each message carries its own length in front.
    def all_gather(self, data):
        top = self._largest(len(data))
        if top == 0:
            return [b""] * self._size
        out = [self._torch.empty(top + 8, dtype=self._torch.uint8)
               for _ in range(self._size)]
        self._dist.all_gather(
            out, self._u8(data, top + 8, np.int64(len(data)).tobytes()),
            group=self._group)
        return [self._unprefixed(t) for t in out]

    def gather(self, data, root):
        top = self._largest(len(data))
        if top == 0:
            return [b""] * self._size if self._rank == root else []
        out = None
        if self._rank == root:
            out = [self._torch.empty(top + 8, dtype=self._torch.uint8)
                   for _ in range(self._size)]
        self._dist.gather(self._u8(data, top + 8, np.int64(len(data)).tobytes()),
                          gather_list=out, group=self._group, group_dst=root)
        if self._rank != root:
            return []
        return [self._unprefixed(t) for t in out]

    def scatter(self, data, root):
        sizes = self._i64([len(d) for d in data] if self._rank == root
                          else [0] * self._size)
        self._dist.broadcast(sizes, group=self._group, group_src=root)
        sizes = [int(v) for v in sizes.tolist()]
        top = max(sizes)
        if top == 0:
            return b""
        chunks = None
        if self._rank == root:
            chunks = [self._u8(d, top) for d in data]
        out = self._torch.empty(top, dtype=self._torch.uint8)
        self._dist.scatter(out, scatter_list=chunks, group=self._group,
                           group_src=root)
        return out[:sizes[self._rank]].numpy().tobytes()

    def all_reduce(self, values, op):
        if not values:
            return []
        ops = {"sum": self._dist.ReduceOp.SUM, "min": self._dist.ReduceOp.MIN,
               "max": self._dist.ReduceOp.MAX}
        t = self._i64(values)
        self._dist.all_reduce(t, op=ops[op], group=self._group)
        return [int(v) for v in t.tolist()]

    def broadcast_into(self, buffer, root):
        if len(buffer) == 0:
            return
        t = self._torch.frombuffer(buffer, dtype=self._torch.uint8)
        self._dist.broadcast(t, group=self._group, group_src=root)

    def split(self, color, key):
        mine = self.all_gather(f"{color} {key}".encode())
        members = []
        for r, m in enumerate(mine):
            c, k = (int(v) for v in m.split())
            if c == color:
                members.append((k, r))
        ranks = [self._ranks[r] for _, r in sorted(members)]
        # Only this color's ranks make its group; ranks are sorted by
        # (key, old rank), which new_group keeps with sort_ranks=False.
        group = self._dist.new_group(ranks=ranks, backend="gloo",
                                     use_local_synchronization=True,
                                     sort_ranks=False)
        return TorchCommunicator(group)


def resolve(comm):
    """The ``_cairn.Communicator`` for a ``comm`` argument, or None (this
    process alone)."""
    if comm is None:
        if not _torch_initialized():
            return None
        comm = _dist().group.WORLD
    if isinstance(comm, _cairn.Communicator):
        return comm
    dist = _dist()
    if dist is not None and isinstance(comm, dist.ProcessGroup):
        return _torch_communicator(comm)
    if all(hasattr(comm, m) for m in ("rank", "size", "all_gather")):
        return _cairn.python_communicator(comm)
    raise TypeError(
        "comm must be None, a torch.distributed ProcessGroup, a "
        f"cairn.Communicator or a communicator object, not {type(comm).__name__}")


def _torch_communicator(group):
    """cairn's communicator for the torch group `group`: over a gloo group
    of the same ranks, made once and kept, so cairn's messages never mix
    with the application's."""
    dist = _dist()
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (_job(), ranks)
    with _lock:
        cached = _torch_comms.get(key)
    if cached is not None:
        return cached
    if len(ranks) == dist.get_world_size():
        gloo = dist.new_group(backend="gloo")
    else:
        gloo = dist.new_group(ranks=list(ranks), backend="gloo",
                              use_local_synchronization=True)
    made = _cairn.python_communicator(TorchCommunicator(gloo))
    with _lock:
        return _torch_comms.setdefault(key, made)
