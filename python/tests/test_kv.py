"""Key-value embedding tables from Python: sources and sinks written in
Python, the library's in-memory and RocksDB tables, round trips in one
process and in real torch.distributed jobs (gloo, one process per rank)
into other world sizes and bucketings, and each kind of failure."""

import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cairn
from gloo_jobs import init, run
from conftest import data_files
from kv_util import (CollectingSink, DictSource, check_rows, check_table,
                     dict_rows, ids_of, rows_of, spec)

ALL = ["weight", "momentum", "count"]


def save_one(path, ids, table_spec=None, **kw):
    table_spec = table_spec or spec()
    source = DictSource(table_spec, dict_rows(ids), (0, table_spec.num_buckets),
                        batch=37)
    result = cairn.save({}, path, kv_tables=[
        cairn.KvTableToSave("emb.user", table_spec, source)], **kw)
    return result, source


# ---- the model --------------------------------------------------------------

def test_spec_normalizes_dtypes_and_is_checked():
    s = spec()
    assert [c.dtype for c in s.columns] == ["BF16", "F32", "I64"]
    assert s.row_bytes == 8 * 2 + 8 * 4 + 8
    assert cairn.KvColumn("w", "bfloat16", 2) == cairn.KvColumn("w", "BF16", 2)
    assert cairn.KvTableSpec(4, [("w", torch.float16, 3)]).columns[0].width == 3
    with pytest.raises(cairn.InvalidArgumentError, match="at least one"):
        cairn.KvTableSpec(0, [("w", "F32", 1)])
    with pytest.raises(cairn.InvalidArgumentError, match="bucket size"):
        cairn.KvTableSpec(4, [("w", "F32", 1)], "chunked")
    with pytest.raises(cairn.InvalidArgumentError, match="two columns"):
        cairn.KvTableSpec(4, [("w", "F32", 1), ("w", "F16", 1)])
    with pytest.raises(cairn.InvalidArgumentError, match="bucketing"):
        cairn.KvTableSpec(4, [("w", "F32", 1)], "hashed")
    with pytest.raises(cairn.InvalidArgumentError, match="dtype"):
        cairn.KvColumn("w", "float128", 1)
    with pytest.raises(cairn.InvalidArgumentError):
        cairn.KvColumn("w", torch.complex128, 1)


def test_bucketing():
    assert [cairn.kv_buckets_of_rank(10, 4, r) for r in range(4)] == [
        (0, 3), (3, 6), (6, 8), (8, 10)]
    assert cairn.kv_buckets_of_rank(2, 3, 2) == (2, 2)
    with pytest.raises(cairn.InvalidArgumentError):
        cairn.kv_buckets_of_rank(4, 2, 2)
    s = spec(5)
    assert cairn.kv_bucket_of(s, 12) == 2
    assert cairn.kv_bucket_of(s, torch.tensor([0, 6, 14])).tolist() == [0, 1, 4]
    chunked = spec(4, "chunked", 10)
    assert cairn.kv_bucket_of(chunked, np.array([0, 9, 10, 39])).tolist() == [
        0, 0, 1, 3]
    with pytest.raises(cairn.InvalidArgumentError, match="id 40 is past"):
        cairn.kv_bucket_of(chunked, np.array([1, 40]))
    with pytest.raises(cairn.InvalidArgumentError, match="negative"):
        cairn.kv_bucket_of(s, -1)


# ---- one process --------------------------------------------------------------

def test_python_source_into_python_sinks(ckpt):
    ids = ids_of(1000)
    result, source = save_one(ckpt, ids, kv_chunk_bytes=4096)
    assert result.kv_rows == len(ids)
    assert source.calls == ["begin", "end"]
    md = cairn.read_metadata(ckpt)
    t = md["kv_tables"]["emb.user"]
    assert t["spec"] == spec() and t["rows"] == len(ids)
    assert t["buckets"] == (0, 16) and sum(t["rows_per_bucket"]) == len(ids)
    assert t["chunks"] > 1 and t["bytes"] == len(ids) * (8 + spec().row_bytes)

    sink = CollectingSink()
    loaded = cairn.load({}, ckpt, kv_tables=[
        cairn.KvTableToLoad("emb.user", sink)])
    assert loaded.kv_rows == len(ids)
    got, cols = sink.result()
    assert sorted(got.tolist()) == ids.tolist()
    check_rows(got, cols, ALL)
    assert cols[2].shape == (len(ids), 1)

    # A column subset, in another order, as a dict entry.
    sink = CollectingSink()
    cairn.load({}, ckpt, kv_tables=[
        {"fqn": "emb.user", "sink": sink, "columns": ["count", "weight"]}])
    got, cols = sink.result()
    assert sorted(got.tolist()) == ids.tolist()
    check_rows(got, cols, ["count", "weight"])


def test_table_files_open_with_safetensors(ckpt):
    """The reference safetensors reader opens the table's files (no holes,
    every entry where its header says) and finds every saved row: each
    chunk's ids beside its columns, row i of each the i-th id's."""
    from safetensors import safe_open
    ids = ids_of(3000, seed=8)
    save_one(ckpt, ids, kv_chunk_bytes=20_000, write_buffer_bytes=4096)
    files = [p for p in data_files(ckpt) if "-kv" in p.name]
    assert files
    seen = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata()["format"] == "cairn"
            chunks = sorted({k.rsplit(".", 1)[0] for k in f.keys()})
            for chunk in chunks:
                assert chunk.startswith("emb.user@kv")
                got = f.get_tensor(chunk + ".ids")
                want = rows_of(got.numpy())
                for name in ALL:
                    assert torch.equal(f.get_tensor(f"{chunk}.{name}"),
                                       want[name]), (path.name, chunk, name)
                seen.extend(got.tolist())
    assert sorted(seen) == ids.tolist()


def test_numpy_sink_and_numpy_source(ckpt):
    ids = ids_of(300, seed=3)
    s = spec()
    source = DictSource(s, dict_rows(ids), (0, 16), batch=50,
                        framework="numpy")
    cairn.save({}, ckpt, kv_tables=[cairn.KvTableToSave("t", s, source)])
    sink = CollectingSink()
    cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad(
        "t", sink, columns=["momentum", "count"], framework="numpy")])
    got, cols = sink.result()
    assert all(isinstance(c, np.ndarray) for c in cols)
    assert cols[0].dtype == np.float32 and cols[1].dtype == np.int64
    check_rows(got, cols, ["momentum", "count"])
    assert sorted(got.tolist()) == ids.tolist()


def test_tables_beside_a_state_dict_and_other_bucketings(ckpt):
    ids = ids_of(800, seed=4)
    s = spec()
    source = DictSource(s, dict_rows(ids), (0, 16))
    cairn.save({"w": torch.arange(6.0)}, ckpt,
               kv_tables=[cairn.KvTableToSave("emb", s, source)])
    sd = {"w": torch.zeros(6)}
    # Into cairn tables of other bucketings, each holding its buckets.
    for dest in (spec(5), spec(3, "chunked", 400_000)):
        parts = [cairn.InMemoryKvTable("emb", dest, (0, 2)),
                 cairn.InMemoryKvTable("emb", dest, (2, dest.num_buckets))]
        for p in parts:
            r = cairn.load(sd, ckpt, kv_tables=[cairn.KvTableToLoad("emb", p)])
            assert r.kv_rows == p.size
        assert torch.equal(sd["w"], torch.arange(6.0))
        held = np.concatenate([p.ids() for p in parts])
        assert sorted(held.tolist()) == ids.tolist()
        for p in parts:
            b = cairn.kv_bucket_of(dest, p.ids())
            assert ((b >= p.owned[0]) & (b < p.owned[1])).all()
            check_table(p, p.ids())


def test_in_memory_table_as_source_and_sink(ckpt):
    ids = ids_of(500, seed=5)
    s = spec(8)
    table = cairn.InMemoryKvTable("emb", s)
    cols = rows_of(ids)
    table.apply(ids, [cols["weight"], cols["momentum"], cols["count"][:, 0]])
    assert table.size == len(table) == len(ids)
    assert table.find(int(ids.max()) + 1) is None
    assert sum(table.rows_per_bucket()) == len(ids)
    row = table.find(int(ids[3]))
    assert isinstance(row, bytes) and len(row) == s.row_bytes
    # Pulled from Python: new tensors in (bucket, id) order.
    src = table.source(64)
    src.begin()
    pulled = []
    while (batch := src.next()) is not None:
        pulled.append(batch)
    src.end()
    got = torch.cat([b[0] for b in pulled]).numpy()
    order = np.lexsort((ids, cairn.kv_bucket_of(s, ids)))
    assert np.array_equal(got, ids[order])
    check_rows(got, [torch.cat([b[1][j] for b in pulled]) for j in range(3)],
               ALL)
    del src

    result = cairn.save({}, ckpt, kv_tables=[
        cairn.KvTableToSave("emb", source=table)])  # spec and buckets: its own
    assert result.kv_rows == len(ids)
    back = cairn.InMemoryKvTable("emb", s)
    cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad("emb", back)])
    check_table(back, ids)
    # A table of a column subset loads just those columns.
    weights = cairn.InMemoryKvTable(
        "emb", cairn.KvTableSpec(8, [s.columns[0]]), (2, 5))
    cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad("emb", weights)])
    b = cairn.kv_bucket_of(s, ids)
    assert sorted(weights.ids().tolist()) == ids[(b >= 2) & (b < 5)].tolist()
    check_table(weights, ids[(b >= 2) & (b < 5)])


def test_rocksdb_round_trip(tmp_path):
    ids = ids_of(2000, seed=6)
    s = spec()
    ckpt = tmp_path / "ckpt"
    with cairn.RocksDbKvTable(tmp_path / "src", "emb", s) as db:
        cols = rows_of(ids)
        for lo in range(0, len(ids), 500):
            part = slice(lo, lo + 500)
            db.apply(ids[part], [cols["weight"][part], cols["momentum"][part],
                                 cols["count"][part]])
        db.flush()
        assert db.size == len(ids)
        assert np.array_equal(db.ids(), ids[np.lexsort(
            (ids, cairn.kv_bucket_of(s, ids)))])
        src = db.source(100)
        with pytest.raises(cairn.FailedPreconditionError, match="in use"):
            db.close()
        del src
        r = cairn.save({}, ckpt, kv_tables=[cairn.KvTableToSave(
            "emb", source=db.source(128))], kv_chunk_bytes=16 << 10)
        assert r.kv_rows == len(ids)
    with pytest.raises(cairn.FailedPreconditionError, match="closed"):
        db.size
    dest = spec(6, "chunked", 200_000)
    halves = []
    for i, owned in enumerate([(0, 3), (3, 6)]):
        db = cairn.RocksDbKvTable(tmp_path / f"dst{i}", "emb", dest, owned)
        r = cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad("emb", db)])
        assert r.kv_rows == db.size
        db.close()
        halves.append(db)
    # Reopened: the rows are durable, and the spec is checked.
    held = []
    for i, owned in enumerate([(0, 3), (3, 6)]):
        with cairn.RocksDbKvTable(tmp_path / f"dst{i}", "emb", dest, owned,
                                  create_if_missing=False) as db:
            check_table(db, db.ids())
            held.extend(db.ids().tolist())
    assert sorted(held) == ids.tolist()
    with pytest.raises(cairn.FailedPreconditionError):
        cairn.RocksDbKvTable(tmp_path / "dst0", "emb", spec(7), (0, 3))


# ---- failures, one process ----------------------------------------------------

class Failing:
    def __init__(self, exc):
        self.exc = exc

    def next(self):
        raise self.exc

    def apply(self, ids, columns):
        raise self.exc


def test_python_exceptions_become_the_error(ckpt):
    s = spec()
    with pytest.raises(cairn.InvalidArgumentError,
                       match='"emb".*ValueError: bad row') as info:
        cairn.save({}, ckpt, kv_tables=[
            cairn.KvTableToSave("emb", s, Failing(ValueError("bad row")))])
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(cairn.Error, match="RuntimeError: disk gone"):
        cairn.save({}, ckpt, kv_tables=[
            cairn.KvTableToSave("emb", s, Failing(RuntimeError("disk gone")))])
    with pytest.raises(cairn.NotFoundError):  # nothing was committed
        cairn.read_metadata(ckpt)
    save_one(ckpt, ids_of(50))
    with pytest.raises(cairn.DeadlineExceededError, match="TimeoutError"):
        cairn.load({}, ckpt, kv_tables=[
            cairn.KvTableToLoad("emb.user", Failing(TimeoutError("slow")))])
    with pytest.raises(cairn.DataLossError, match="its own"):
        cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad(
            "emb.user", Failing(cairn.DataLossError("its own")))])


def test_bad_batches_name_the_table_and_column(ckpt):
    s = spec()
    ids = np.array([1, 2], dtype=np.int64)
    good = rows_of(ids)

    def save_batch(ids, cols):
        class One:
            done = False

            def next(self):
                if self.done:
                    return None
                self.done = True
                return ids, cols
        return cairn.save({}, ckpt, kv_tables=[
            cairn.KvTableToSave("emb", s, One())])

    cols = [good["weight"], good["momentum"], good["count"]]
    with pytest.raises(cairn.InvalidArgumentError,
                       match="'emb'.*column 'momentum' is F64"):
        save_batch(ids, [cols[0], cols[1].double(), cols[2]])
    with pytest.raises(cairn.InvalidArgumentError, match="'weight' is BF16 \\[2, 4\\]"):
        save_batch(ids, [cols[0][:, :4], cols[1], cols[2]])
    with pytest.raises(cairn.InvalidArgumentError, match="ids is I32"):
        save_batch(ids.astype(np.int32), cols)
    with pytest.raises(cairn.InvalidArgumentError, match="list of 3"):
        save_batch(ids, cols[:2])
    with pytest.raises(cairn.InvalidArgumentError, match="order"):
        save_batch(ids[::-1].copy(), cols)
    with pytest.raises(cairn.InvalidArgumentError, match="next"):
        cairn.save({}, ckpt, kv_tables=[cairn.KvTableToSave("emb", s, object())])
    with pytest.raises(TypeError, match="kv_tables"):
        cairn.AsyncSaver().save({}, ckpt, kv_tables=[])
    table = cairn.InMemoryKvTable("emb", s, (0, 1))
    with pytest.raises(cairn.InvalidArgumentError, match="bucket"):
        table.apply(ids, cols)
    assert table.size == 0


def test_missing_table(ckpt):
    save_one(ckpt, ids_of(10))
    with pytest.raises(cairn.NotFoundError, match="other"):
        cairn.load({}, ckpt, kv_tables=[
            cairn.KvTableToLoad("other", CollectingSink())])
    r = cairn.load({}, ckpt, strict=False, kv_tables=[
        cairn.KvTableToLoad("other", CollectingSink())])
    assert r.missing == ["other"]


def test_threads_as_ranks(ckpt):
    """In-process ranks: every rank's Python callbacks take the GIL in turn."""
    import threading
    ids = ids_of(600, seed=8)
    s = spec()
    rows = dict_rows(ids)
    comms = cairn.in_process(3)
    errors = []

    def each(fn):
        threads = [threading.Thread(target=fn, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def saver(rank):
        try:
            src = DictSource(s, rows, cairn.kv_buckets_of_rank(16, 3, rank))
            cairn.save({}, ckpt, comm=comms[rank], kv_tables=[
                cairn.KvTableToSave("emb", s, src)])
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    each(saver)
    assert not errors, errors
    sinks = [CollectingSink() for _ in range(3)]

    def failing_loader(rank):
        sink = Failing(ValueError("rank 1 sink")) if rank == 1 else sinks[rank]
        try:
            cairn.load({}, ckpt, comm=comms[rank], kv_tables=[
                cairn.KvTableToLoad("emb", sink, num_buckets=4)])
        except cairn.Error as e:
            errors.append(str(e))

    each(failing_loader)
    assert len(errors) == 3 and all("ValueError: rank 1 sink" in e
                                    for e in errors), errors


# ---- real torch.distributed jobs ---------------------------------------------

N_IDS = 3000


def dist_save_job(rank, world, port, out):
    init(rank, world, port)
    s = spec()
    rows = dict_rows(ids_of(N_IDS, seed=9))
    source = DictSource(s, rows, cairn.kv_buckets_of_rank(16, world, rank),
                        batch=128)
    result = cairn.save({"step": 7}, pathlib.Path(out) / "ckpt", kv_tables=[
        cairn.KvTableToSave("emb.user", s, source)], kv_chunk_bytes=8192)
    assert result.kv_rows == len(source.ids) and result.world_size == world
    dist.destroy_process_group()


def dist_load_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    ckpt = out / "ckpt"
    ids = ids_of(N_IDS, seed=9)
    # The saved bucketing, into cairn tables.
    table = cairn.InMemoryKvTable("emb.user", spec(),
                                  cairn.kv_buckets_of_rank(16, world, rank))
    r = cairn.load({"step": 0}, ckpt, kv_tables=[
        cairn.KvTableToLoad("emb.user", table)])
    assert r.kv_rows == table.size
    b = cairn.kv_bucket_of(spec(), ids)
    lo, hi = table.owned
    check_table(table, ids[(b >= lo) & (b < hi)])
    np.save(out / f"saved-{rank}.npy", table.ids())
    # Another bucketing (interleaved, 7 buckets) into cairn tables.
    other = spec(7)
    table = cairn.InMemoryKvTable("emb.user", other,
                                  cairn.kv_buckets_of_rank(7, world, rank))
    cairn.load({}, ckpt, kv_tables=[cairn.KvTableToLoad("emb.user", table)])
    b = cairn.kv_bucket_of(other, ids)
    lo, hi = table.owned
    check_table(table, ids[(b >= lo) & (b < hi)])
    # Another bucketing (chunked, 5 buckets), into Python sinks; a column
    # subset into a NumPy sink.
    dest = spec(5, "chunked", 200_000)
    sink, numpy_sink = CollectingSink(), CollectingSink()
    r = cairn.load({}, ckpt, strict=False, kv_tables=[
        cairn.KvTableToLoad("emb.user", sink, num_buckets=5,
                            bucketing="chunked", bucket_size=200_000)])
    got, cols = sink.result()
    assert r.kv_rows == len(got)
    cairn.load({}, ckpt, strict=False, kv_tables=[
        {"fqn": "emb.user", "sink": numpy_sink, "num_buckets": 5,
         "bucketing": "chunked", "bucket_size": 200_000,
         "columns": ["count", "momentum"], "framework": "numpy"}])
    lo, hi = cairn.kv_buckets_of_rank(5, world, rank)
    b = cairn.kv_bucket_of(dest, ids)
    assert sorted(got.tolist()) == ids[(b >= lo) & (b < hi)].tolist()
    check_rows(got, cols, ALL)
    np_ids, np_cols = numpy_sink.result()
    assert sorted(np_ids.tolist()) == sorted(got.tolist())
    check_rows(np_ids, np_cols, ["count", "momentum"])
    np.save(out / f"other-{rank}.npy", got)
    dist.destroy_process_group()


def dist_errors_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    s = spec()
    rows = dict_rows(ids_of(400, seed=10))
    mine = cairn.kv_buckets_of_rank(16, world, rank)
    # Rank 1 yields rows of rank 0's buckets too.
    source = DictSource(s, rows, (0, 16) if rank == 1 else mine)
    with pytest.raises(cairn.InvalidArgumentError,
                       match=r'"emb.bad".*not one of this rank'):
        cairn.save({}, out / "bad", kv_tables=[
            cairn.KvTableToSave("emb.bad", s, source)])
    source = DictSource(s, rows, mine)
    cairn.save({}, out / "good", kv_tables=[
        cairn.KvTableToSave("emb", s, source)])
    # Rank 0's sink raises: every rank fails, naming it.
    sink = Failing(ValueError("no room")) if rank == 0 else CollectingSink()
    with pytest.raises(cairn.Error, match="ValueError: no room") as info:
        cairn.load({}, out / "good", kv_tables=[
            cairn.KvTableToLoad("emb", sink, num_buckets=3)])
    if rank == 0:
        assert isinstance(info.value.__cause__, ValueError)
    # The ranks are still in step.
    sink = CollectingSink()
    r = cairn.load({}, out / "good", kv_tables=[
        cairn.KvTableToLoad("emb", sink)])
    assert r.kv_rows == len(sink.result()[0]) > 0
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv")
    run(dist_save_job, 2, out)
    return out


def test_two_ranks_save_from_python_sources(saved_by_two):
    md = cairn.read_metadata(saved_by_two / "ckpt")
    t = md["kv_tables"]["emb.user"]
    assert md["world_size"] == 2 and t["rows"] == N_IDS and t["chunks"] > 2
    assert md["scalars"]["step"] == 7


def test_three_ranks_load_every_row(saved_by_two):
    run(dist_load_job, 3, saved_by_two)
    ids = ids_of(N_IDS, seed=9).tolist()
    for kind in ("saved", "other"):
        parts = [np.load(saved_by_two / f"{kind}-{r}.npy") for r in range(3)]
        assert sorted(np.concatenate(parts).tolist()) == ids, kind


def test_errors_on_every_rank(tmp_path):
    run(dist_errors_job, 2, tmp_path)
