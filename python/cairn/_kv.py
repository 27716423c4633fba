"""Key-value embedding tables (include/cairn/kv_table.h) from Python.

A table has int64 global ids, rows of columns (the weight, optimizer
state, per-row metadata: each a dtype and a width), and a bucketing fixed
when it is created: B buckets, id -> bucket by id % B ("interleaved") or
id // bucket_size ("chunked"). Each rank saves the rows of a contiguous
range of buckets (kv_buckets_of_rank by default) from a *source*, and a
load hands each rank the rows of its buckets, in any world size and any
bucketing, through a *sink*.

A source is any object with next() -> None (no more rows) or (ids,
columns): ids a 1-D int64 torch tensor or NumPy array, columns a list of
[n, width] tensors or arrays, one per column of the spec in its order and
dtype (a 1-D one for a column of width 1); rows in (bucket, id) order,
every id in one of the rank's buckets; begin() and end() are called
around the pulls when the source has them. A sink is any object with
apply(ids, columns), which gets torch tensors (framework="torch") or NumPy
arrays ("numpy") viewing cairn's buffers: valid only during the call, so
copy what you keep. cairn.InMemoryKvTable and cairn.RocksDbKvTable are
both, without Python in between.
"""

import contextlib
import dataclasses
from typing import Any, Optional

import numpy as np

from . import _cairn, _state
from ._errors import Error, FailedPreconditionError, InvalidArgumentError

_BUCKETINGS = ("interleaved", "chunked")


def _dtype_name(dtype, column):
    """cairn's name ("F32", "BF16") of a torch dtype, a NumPy dtype, or a
    name (cairn's, torch's or NumPy's: "BF16", "bfloat16", "float32")."""
    if isinstance(dtype, str):
        if dtype in _cairn.dtype_names():
            return dtype
        name = _state._TORCH_NAMES.get(dtype.removeprefix("torch."))
        if name is not None:
            return name
        raise InvalidArgumentError(
            f"'{column}': unknown dtype {dtype!r} (cairn's names: "
            f"{', '.join(_cairn.dtype_names())})")
    torch = _state._torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        return _state.torch_dtype_name(dtype, column)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(
            f"'{column}': {dtype!r} is not a dtype") from None
    return _state.numpy_dtype_name(np_dtype, column)


@dataclasses.dataclass(frozen=True)
class KvColumn:
    """One column of a row: `dtype` a torch dtype, a NumPy dtype or a name
    (kept as cairn's safetensors name, "F32", "BF16", ...), `width`
    elements a row."""

    name: str
    dtype: Any
    width: int = 1

    def __post_init__(self):
        object.__setattr__(self, "dtype",
                           _dtype_name(self.dtype, self.name))
        object.__setattr__(self, "width", int(self.width))


def _column(c):
    if isinstance(c, KvColumn):
        return c
    if isinstance(c, dict):
        return KvColumn(**c)
    return KvColumn(*c)


@dataclasses.dataclass(frozen=True)
class KvTableSpec:
    """A table's layout and bucketing, fixed when it is created.

    `columns`: KvColumns (or (name, dtype, width) tuples). `bucketing`:
    "interleaved" (bucket = id % num_buckets, any id >= 0) or "chunked"
    (bucket = id // bucket_size, ids below num_buckets * bucket_size).
    Checked when made (cairn.InvalidArgumentError)."""

    num_buckets: int
    columns: tuple
    bucketing: str = "interleaved"
    bucket_size: int = 0

    def __post_init__(self):
        object.__setattr__(self, "num_buckets", int(self.num_buckets))
        object.__setattr__(self, "bucket_size", int(self.bucket_size))
        object.__setattr__(self, "columns",
                           tuple(_column(c) for c in self.columns))
        if self.bucketing not in _BUCKETINGS:
            raise InvalidArgumentError(
                f"bucketing must be 'interleaved' or 'chunked', not "
                f"{self.bucketing!r}")
        _cairn.kv_check_spec(self, "spec")

    @property
    def row_bytes(self):
        """Bytes of one row, every column."""
        return _cairn.kv_row_bytes(self)

    def column_names(self):
        return [c.name for c in self.columns]


def _spec_from_dict(d):
    return KvTableSpec(d["num_buckets"], [KvColumn(**c) for c in d["columns"]],
                       d["bucketing"], d["bucket_size"])


def kv_buckets_of_rank(num_buckets, world, rank):
    """The buckets [begin, end) that rank `rank` of `world` owns by
    default: contiguous ranges in rank order, the first num_buckets % world
    ranks one bucket more (empty past num_buckets)."""
    return _cairn.kv_buckets_of_rank(int(num_buckets), int(world), int(rank))


def kv_bucket_of(spec, ids):
    """The bucket of an id (an int), or of each of an array or tensor of
    ids (an int64 NumPy array). cairn.InvalidArgumentError naming the id for
    a negative one, or one past a chunked table's ids."""
    if isinstance(ids, (int, np.integer)):
        return _cairn.kv_bucket_of(spec, int(ids))
    if _state._is_torch_tensor(ids):
        ids = ids.detach().cpu().numpy()
    return _cairn.kv_buckets_of_ids(spec, np.asarray(ids, dtype=np.int64))


# ---- batches in and out ---------------------------------------------------

def _bits(x, expected, what, shape):
    """The DLPack exporter of `x`'s host bytes, once its dtype is `expected`
    and its shape `shape` (-1: any)."""
    if _state._is_torch_tensor(x):
        if x.device.type != "cpu":
            x = x.detach().cpu()
    elif not isinstance(x, np.ndarray):
        raise InvalidArgumentError(
            f"{what} must be a torch tensor or a NumPy array, not "
            f"{type(x).__name__}")
    try:
        name, bits = _state._local_leaf(x, "")
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{what} is {x.dtype}, a dtype cairn does not store") from None
    got = list(x.shape)
    if name != expected or len(got) != len(shape) or any(
            s not in (-1, g) for s, g in zip(shape, got)):
        want = ", ".join("n" if s == -1 else str(s) for s in shape)
        raise InvalidArgumentError(
            f"{what} is {name} {got}, not {expected} [{want}]")
    return bits


def _batch_bits(fqn, spec, batch):
    """(ids, [columns]) as the extension takes them: DLPack exporters of
    host memory, checked against the spec."""
    where = f"key-value table {fqn!r}"
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InvalidArgumentError(
            f"{where}: a batch is (ids, columns), not {type(batch).__name__}")
    ids, columns = batch
    ids_bits = _bits(ids, "I64", f"{where}: ids", [-1])
    n = ids.shape[0]
    if not isinstance(columns, (list, tuple)) or len(columns) != len(
            spec.columns):
        raise InvalidArgumentError(
            f"{where}: columns must be a list of {len(spec.columns)} "
            f"({', '.join(spec.column_names())})")
    out = []
    for col, x in zip(spec.columns, columns):
        if col.width == 1 and len(getattr(x, "shape", ())) == 1:
            x = x.reshape(-1, 1)
        out.append(_bits(x, col.dtype, f"{where}: column {col.name!r}",
                         [n, col.width]))
    return ids_bits, out


def _as_framework(x, framework, fqn):
    """An `Exported` of table `fqn` as a torch tensor or NumPy array (no
    copy)."""
    if framework == "torch":
        import torch
        return torch.from_dlpack(x).view(_state.torch_dtype(x.dtype))
    return np.from_dlpack(x).view(_state.numpy_dtype(x.dtype, fqn))


def _check_framework(framework):
    if framework not in ("torch", "numpy"):
        raise InvalidArgumentError(
            f"framework must be 'torch' or 'numpy', not {framework!r}")


class _Source:
    """A user's source as the extension calls it (python/src/kv.h): each
    batch checked and handed over as exporters. Keeps the first exception
    the user's code raised, which the save's error is raised from."""

    def __init__(self, fqn, spec, source):
        self._fqn, self._spec, self._source = fqn, spec, source
        self.error = None

    def _call(self, name):
        method = getattr(self._source, name, None)
        if method is None:
            return None
        try:
            return method()
        except BaseException as e:
            self.error = self.error or e
            raise

    def begin(self):
        self._call("begin")

    def next(self):
        got = self._call("next")
        return None if got is None else _batch_bits(self._fqn, self._spec, got)

    def end(self):
        self._call("end")


class _Sink:
    """A user's sink as the extension calls it: cairn's buffers as torch
    tensors or NumPy arrays, without a copy."""

    def __init__(self, fqn, sink, framework):
        self._fqn, self._sink, self._framework = fqn, sink, framework
        self.error = None

    def apply(self, ids, columns):
        ids = _as_framework(ids, self._framework, self._fqn)
        columns = [_as_framework(c, self._framework, self._fqn)
                   for c in columns]
        try:
            self._sink.apply(ids, columns)
        except BaseException as e:
            self.error = self.error or e
            raise


# ---- the library's tables --------------------------------------------------

class KvTableSource:
    """The rows of a cairn table in (bucket, id) order, `batch_rows` at a
    time: pass it (or the table) as a save's source, or pull it yourself:
    begin(), then next() until None, then end(). next() returns (ids,
    columns) as new torch tensors (framework="torch") or NumPy arrays.
    begin() takes a snapshot (RocksDB) or the ids then present (in memory:
    the table must not change until end())."""

    def __init__(self, table, batch_rows, framework):
        _check_framework(framework)
        self._impl = table._live().source(int(batch_rows))
        self._framework = framework
        self.table = table

    def begin(self):
        self._impl.begin()

    def next(self):
        got = self._impl.next()
        if got is None:
            return None
        ids, columns = got
        name = self.table.name
        return (_as_framework(ids, self._framework, name),
                [_as_framework(c, self._framework, name) for c in columns])

    def end(self):
        self._impl.end()


class _KvTable:
    def _init(self, impl, name, spec, owned):
        self._impl, self._name, self._spec, self._owned = impl, name, spec, owned

    def _live(self):
        if self._impl.closed:
            raise FailedPreconditionError(
                f"key-value table {self._name!r} is closed")
        return self._impl

    @property
    def name(self):
        return self._name

    @property
    def spec(self):
        return self._spec

    @property
    def owned(self):
        """The buckets (begin, end) whose rows the table holds."""
        return self._owned

    @property
    def size(self):
        """The number of rows (RocksDB: counted, reading every key)."""
        return self._live().size()

    def __len__(self):
        return self.size

    def rows_per_bucket(self):
        """Row counts of the owned buckets, in bucket order."""
        return self._live().rows_per_bucket()

    def ids(self):
        """Every id held, as an int64 NumPy array (RocksDB: in (bucket, id)
        order; in memory: in no particular order)."""
        return self._live().ids()

    def find(self, id):
        """Row `id`'s bytes (every column's elements one after another), or
        None when the table has no such id."""
        return self._live().find(int(id))

    def row(self, id, *, framework="torch"):
        """Row `id` as a tuple of 1-D tensors (or NumPy arrays), one per
        column, copies; None when the table has no such id."""
        _check_framework(framework)
        data = self.find(id)
        if data is None:
            return None
        out, at = [], 0
        for c in self._spec.columns:
            n = c.width * _cairn.dtype_size(c.dtype)
            raw = np.frombuffer(data, dtype=np.uint8, count=n, offset=at).copy()
            if framework == "torch":
                import torch
                out.append(torch.from_numpy(raw).view(_state.torch_dtype(c.dtype)))
            else:
                out.append(raw.view(_state.numpy_dtype(c.dtype, c.name)))
            at += n
        return tuple(out)

    def apply(self, ids, columns):
        """Inserts or overwrites rows: ids and columns as a source's batch.
        Refuses (cairn.InvalidArgumentError, changing nothing) ids of
        buckets the table does not own."""
        ids_bits, cols = _batch_bits(self._name, self._spec, (ids, columns))
        self._live().apply(ids_bits, cols)

    def source(self, batch_rows=None, *, framework="torch"):
        """A KvTableSource of the rows; batch_rows defaults to about 1 MiB of
        rows."""
        if batch_rows is None:
            batch_rows = max(1, (1 << 20) // self._spec.row_bytes)
        return KvTableSource(self, batch_rows, framework)

    def close(self):
        """Releases the table (RocksDB: closes the database). Refused while
        a source of it is alive or a save or load uses it."""
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"cairn.{type(self).__name__}({self._name!r}, buckets "
                f"{list(self._owned)} of {self._spec.num_buckets})")


def _owned(spec, owned):
    if owned is None:
        return (0, spec.num_buckets)
    begin, end = owned
    return (int(begin), int(end))


class InMemoryKvTable(_KvTable):
    """A table in host memory (a hash map from id to row) holding the rows
    of buckets `owned` ((begin, end); default: all). Not thread-safe."""

    def __init__(self, name, spec, owned=None):
        owned = _owned(spec, owned)
        self._init(_cairn.KvTable.in_memory(name, spec, owned), name, spec,
                   owned)


class RocksDbKvTable(_KvTable):
    """A table in a RocksDB database at `path` (created, recording `spec`,
    unless `create_if_missing` is False), holding the rows of buckets
    `owned` ((begin, end); default: all). Reopening checks the spec and
    that every row is in `owned`. `sync_writes`: fsync the write-ahead log
    on every apply; `disable_wal`: none (rows since the last flush() are
    lost if the process dies). Close it (or use `with`) to release the
    database. Not thread-safe."""

    def __init__(self, path, name, spec, owned=None, *,
                 create_if_missing=True, sync_writes=False,
                 disable_wal=False):
        owned = _owned(spec, owned)
        self.path = str(path)
        self._init(_cairn.KvTable.rocksdb(self.path, name, spec, owned,
                                          create_if_missing, sync_writes,
                                          disable_wal),
                   name, spec, owned)

    def flush(self):
        """Makes every applied row durable."""
        self._live().flush()


# ---- save and load entries --------------------------------------------------

@dataclasses.dataclass
class KvTableToSave:
    """A table for save(kv_tables=[...]) (a dict of these keys does too).

    Every rank lists every table, with the same spec; each saves the rows
    of `buckets` ((begin, end); default kv_buckets_of_rank, or the
    table's own when the source is a cairn table) from `source`: a source
    object, a cairn table or its source(), or None on a rank without
    buckets. `spec` defaults to a cairn table's."""

    fqn: str
    spec: Optional[KvTableSpec] = None
    source: Any = None
    _: dataclasses.KW_ONLY
    buckets: Optional[tuple] = None


@dataclasses.dataclass
class KvTableToLoad:
    """A table for load(kv_tables=[...]) (a dict of these keys does too).

    `sink` gets this rank's rows: a sink object, or a cairn table. The
    destination's bucketing: `num_buckets` (None: the saved table's, or a
    cairn table's own), `bucketing`, `bucket_size`; this rank's `buckets`
    in it ((begin, end); default kv_buckets_of_rank, or a cairn table's
    own). `columns`: the names to load, in this order (None: all, or a
    cairn table's). `framework`: what a sink object gets, "torch" or
    "numpy"."""

    fqn: str
    sink: Any
    _: dataclasses.KW_ONLY
    num_buckets: Optional[int] = None
    bucketing: str = "interleaved"
    bucket_size: int = 0
    buckets: Optional[tuple] = None
    columns: Optional[list] = None
    framework: str = "torch"


def _entry(item, cls):
    if isinstance(item, cls):
        return item
    if isinstance(item, dict):
        try:
            return cls(**item)
        except TypeError as e:
            raise InvalidArgumentError(f"a kv_tables entry: {e}") from None
    raise InvalidArgumentError(
        f"a kv_tables entry must be a cairn.{cls.__name__} or a dict, not "
        f"{type(item).__name__}")


def _range(r):
    return None if r is None else (int(r[0]), int(r[1]))


def save_entries(kv_tables):
    """(the extension's entries, the Python sources that may record a
    user's exception)."""
    entries, wrappers = [], []
    for item in kv_tables or ():
        t = _entry(item, KvTableToSave)
        source, spec, buckets = t.source, t.spec, _range(t.buckets)
        table = source if isinstance(source, _KvTable) else (
            source.table if isinstance(source, KvTableSource) else None)
        if table is not None:
            spec = spec or table.spec
            buckets = buckets or table.owned
            if isinstance(source, _KvTable):
                source = source.source()
            source = source._impl
        elif source is not None:
            if not callable(getattr(source, "next", None)):
                raise InvalidArgumentError(
                    f"key-value table {t.fqn!r}: a source needs a next() "
                    f"method, {type(source).__name__} has none")
            if not isinstance(spec, KvTableSpec):
                raise InvalidArgumentError(
                    f"key-value table {t.fqn!r}: spec must be a "
                    f"cairn.KvTableSpec")
            source = _Source(t.fqn, spec, source)
            wrappers.append(source)
        if not isinstance(spec, KvTableSpec):
            raise InvalidArgumentError(
                f"key-value table {t.fqn!r}: spec must be a cairn.KvTableSpec")
        entries.append((t.fqn, spec, buckets, source))
    return entries, wrappers


def load_entries(kv_tables):
    """(the extension's entries, the Python sinks)."""
    entries, wrappers = [], []
    for item in kv_tables or ():
        t = _entry(item, KvTableToLoad)
        _check_framework(t.framework)
        if t.bucketing not in _BUCKETINGS:
            raise InvalidArgumentError(
                f"key-value table {t.fqn!r}: bucketing must be 'interleaved' "
                f"or 'chunked', not {t.bucketing!r}")
        sink, buckets, columns = t.sink, _range(t.buckets), t.columns
        num_buckets, bucketing, bucket_size = (
            t.num_buckets, t.bucketing, t.bucket_size)
        if isinstance(sink, _KvTable):
            if num_buckets is None:
                num_buckets = sink.spec.num_buckets
                bucketing, bucket_size = sink.spec.bucketing, sink.spec.bucket_size
            buckets = buckets or sink.owned
            columns = sink.spec.column_names() if columns is None else columns
            sink = sink._live()
        else:
            if not callable(getattr(sink, "apply", None)):
                raise InvalidArgumentError(
                    f"key-value table {t.fqn!r}: a sink needs an apply() "
                    f"method, {type(sink).__name__} has none")
            sink = _Sink(t.fqn, sink, t.framework)
            wrappers.append(sink)
        entries.append((t.fqn, sink, int(num_buckets or 0), bucketing,
                        int(bucket_size), buckets, list(columns or ())))
    return entries, wrappers


@contextlib.contextmanager
def raised_from_callbacks(wrappers):
    """Raises a failed save's or load's cairn.Error from the exception a
    Python source or sink of this rank raised, if one did."""
    try:
        yield
    except Error as e:
        cause = next((w.error for w in wrappers if w.error is not None), None)
        if cause is None:
            raise
        raise e from cause


def tables_of_metadata(md):
    """read_metadata's kv_tables with each spec a KvTableSpec."""
    for t in md.get("kv_tables", {}).values():
        t["spec"] = _spec_from_dict(t["spec"])
    return md

