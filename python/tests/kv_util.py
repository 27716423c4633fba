"""What the key-value table tests share: a table whose rows are a function
of their ids, a source over a dict of such rows, and sinks that collect
what a load hands them."""

import numpy as np
import torch

import cairn

WIDTH = 8


def spec(num_buckets=16, bucketing="interleaved", bucket_size=0):
    """weight (bf16), momentum (f32) and count (int64, width 1)."""
    return cairn.KvTableSpec(num_buckets, [
        cairn.KvColumn("weight", torch.bfloat16, WIDTH),
        cairn.KvColumn("momentum", "F32", WIDTH),
        cairn.KvColumn("count", np.int64, 1),
    ], bucketing, bucket_size)


def ids_of(n, seed=0, high=1_000_000):
    """`n` distinct ids below `high`, the same in every process."""
    rng = np.random.default_rng(seed)
    return np.unique(rng.choice(high, size=n, replace=False)).astype(np.int64)


def rows_of(ids):
    """The columns of rows `ids` (an int64 array): a function of the ids,
    so any rank can check any row; bf16 values that are not round."""
    t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    x = t.double()[:, None] * 0.001 + torch.arange(WIDTH, dtype=torch.float64)
    return {"weight": torch.sin(x).to(torch.bfloat16),
            "momentum": (x * 1.25).to(torch.float32),
            "count": (t * 7 + 1)[:, None]}


class DictSource:
    """A source over a dict {id: (weight, momentum, count)} holding the rows
    of buckets [begin, end) of `spec`: pulls them in (bucket, id) order,
    `batch` at a time, as torch tensors ("torch") or NumPy arrays."""

    def __init__(self, spec, rows, buckets, batch=100, framework="torch"):
        ids = np.array(sorted(rows), dtype=np.int64)
        b = cairn.kv_bucket_of(spec, ids)
        keep = (b >= buckets[0]) & (b < buckets[1])
        order = np.lexsort((ids[keep], b[keep]))
        self.ids = ids[keep][order]
        self.rows, self.batch, self.framework = rows, batch, framework
        self.calls = []

    def begin(self):
        self.calls.append("begin")
        self.at = 0

    def next(self):
        if self.at >= len(self.ids):
            return None
        ids = self.ids[self.at:self.at + self.batch]
        self.at += len(ids)
        cols = [torch.stack([self.rows[int(i)][c] for i in ids])
                for c in range(3)]
        if self.framework == "numpy":
            # bf16 stays torch: NumPy has no bfloat16 without ml_dtypes.
            return ids, [cols[0], cols[1].numpy(), cols[2][:, 0].numpy()]
        return torch.from_numpy(ids), cols

    def end(self):
        self.calls.append("end")


def dict_rows(ids):
    """{id: (weight, momentum, count)} of `ids`, each a 1-D tensor."""
    cols = rows_of(ids)
    return {int(i): (cols["weight"][k], cols["momentum"][k], cols["count"][k])
            for k, i in enumerate(ids)}


class CollectingSink:
    """Copies every row it is given (the views die with the call)."""

    def __init__(self):
        self.ids, self.columns, self.batches = [], None, 0

    def apply(self, ids, columns):
        self.batches += 1
        self.ids.append(ids.numpy().copy() if isinstance(ids, torch.Tensor)
                        else ids.copy())
        copies = [c.clone() if isinstance(c, torch.Tensor) else c.copy()
                  for c in columns]
        if self.columns is None:
            self.columns = [[c] for c in copies]
        else:
            for got, c in zip(self.columns, copies):
                got.append(c)

    def result(self):
        """(ids, columns), each concatenated."""
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        if self.columns is None:
            return ids, []
        cat = [torch.cat(c) if isinstance(c[0], torch.Tensor)
               else np.concatenate(c) for c in self.columns]
        return ids, cat


def check_rows(ids, columns, names):
    """Every row equals rows_of's, column `names[j]` being columns[j]."""
    want = rows_of(ids)
    assert len(columns) == len(names)
    for name, got in zip(names, columns):
        if isinstance(got, np.ndarray):
            got = torch.from_numpy(got)
        w = want[name]
        assert got.dtype == w.dtype, (name, got.dtype, w.dtype)
        assert torch.equal(got, w), name


def check_table(table, ids):
    """`table` holds exactly the rows of `ids`, each as rows_of says."""
    held = np.sort(table.ids())
    assert np.array_equal(held, np.sort(ids))
    want = rows_of(held)
    names = table.spec.column_names()
    for k, i in enumerate(held):
        row = table.row(int(i))
        for name, got in zip(names, row):
            assert torch.equal(got, want[name][k]), (int(i), name)
