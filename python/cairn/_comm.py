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

    Messages are bytes. Every collective is one gloo operation when its
    messages are small (the common case: plan summaries, statuses,
    headers): each message travels in a fixed-size slot with its length in
    front. The part of a message that does not fit its slot follows in a
    second operation that only the ranks concerned take part in (a
    point-to-point send for gather and scatter; a broadcast or all_gather
    that every rank knows to expect from the lengths). On a node with more
    ranks than cores every collective waits for descheduled ranks, so the
    count matters more than the bytes. ``broadcast_into`` moves a large
    buffer in place without a copy (torch.frombuffer on cairn's memory).
    """

    # Slot sizes in bytes, the 8-byte length included: a broadcast's
    # (one message, metadata headers fit) and each rank's in gather,
    # all_gather and scatter (the root holds world x this).
    BROADCAST_SLOT = 64 << 10
    SLOT = 4 << 10

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

    def _slot(self, data, slot):
        """A `slot`-byte tensor: len(data), then as much of data as fits."""
        return self._u8(memoryview(data)[:slot - 8], slot,
                        np.int64(len(data)).tobytes())

    @staticmethod
    def _length(t):
        """The length in front of a slot."""
        return int(t.numpy()[:8].view(np.int64)[0])

    @staticmethod
    def _head(t, n):
        """The first min(n, slot) bytes of a slot's message."""
        return t.numpy()[8:8 + n].tobytes()

    def _rest(self, n, slot):
        """A tensor for the part of an `n`-byte message past its slot."""
        return self._torch.empty(n - (slot - 8), dtype=self._torch.uint8)

    def _i64(self, values):
        return self._torch.tensor(values, dtype=self._torch.int64)

    def barrier(self):
        self._dist.barrier(group=self._group)

    def broadcast(self, data, root):
        slot = self.BROADCAST_SLOT
        t = self._slot(data if self._rank == root else b"", slot)
        self._dist.broadcast(t, group=self._group, group_src=root)
        n = self._length(t)
        if n <= slot - 8:
            return bytes(data) if self._rank == root else self._head(t, n)
        if self._rank == root:
            self._dist.broadcast(self._u8(memoryview(data)[slot - 8:]),
                                 group=self._group, group_src=root)
            return bytes(data)
        rest = self._rest(n, slot)
        self._dist.broadcast(rest, group=self._group, group_src=root)
        return self._head(t, n) + rest.numpy().tobytes()

    def all_gather(self, data):
        slot = self.SLOT
        out = [self._torch.empty(slot, dtype=self._torch.uint8)
               for _ in range(self._size)]
        self._dist.all_gather(out, self._slot(data, slot), group=self._group)
        lengths = [self._length(t) for t in out]
        over = max(lengths) - (slot - 8)
        if over <= 0:
            return [self._head(t, n) for t, n in zip(out, lengths)]
        # Every rank saw the lengths: the rest, padded to the longest.
        mine = memoryview(data)[slot - 8:]
        rests = [self._torch.empty(over, dtype=self._torch.uint8)
                 for _ in range(self._size)]
        self._dist.all_gather(rests, self._u8(mine, over), group=self._group)
        return [self._head(t, n) + r.numpy()[:max(0, n - (slot - 8))].tobytes()
                for t, n, r in zip(out, lengths, rests)]

    def gather(self, data, root):
        slot = self.SLOT
        out = None
        if self._rank == root:
            out = [self._torch.empty(slot, dtype=self._torch.uint8)
                   for _ in range(self._size)]
        self._dist.gather(self._slot(data, slot), gather_list=out,
                          group=self._group, group_dst=root)
        if self._rank != root:
            if len(data) > slot - 8:
                self._dist.send(self._u8(memoryview(data)[slot - 8:]),
                                group=self._group, group_dst=root)
            return []
        messages = []
        for r, t in enumerate(out):
            n = self._length(t)
            if r == root:
                messages.append(bytes(data))
            elif n <= slot - 8:
                messages.append(self._head(t, n))
            else:
                rest = self._rest(n, slot)
                self._dist.recv(rest, group=self._group, group_src=r)
                messages.append(self._head(t, n) + rest.numpy().tobytes())
        return messages

    def scatter(self, data, root):
        slot = self.SLOT
        chunks = None
        if self._rank == root:
            if len(data) != self._size:
                raise ValueError(f"scatter: {len(data)} messages for "
                                 f"{self._size} ranks")
            chunks = [self._slot(d, slot) for d in data]
        out = self._torch.empty(slot, dtype=self._torch.uint8)
        self._dist.scatter(out, scatter_list=chunks, group=self._group,
                           group_src=root)
        if self._rank == root:
            for r, d in enumerate(data):
                if r != root and len(d) > slot - 8:
                    self._dist.send(self._u8(memoryview(d)[slot - 8:]),
                                    group=self._group, group_dst=r)
            return bytes(data[root])
        n = self._length(out)
        head = self._head(out, n)
        if n <= slot - 8:
            return head
        rest = self._rest(n, slot)
        self._dist.recv(rest, group=self._group, group_src=root)
        return head + rest.numpy().tobytes()

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
