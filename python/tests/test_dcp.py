"""The DCP storage plugin (cairn.torch.StorageWriter / StorageReader) in real
torch.distributed jobs (gloo, one process per rank): 4 ranks save an FSDP2
model with AdamW through dcp.save, DTensors through cairn.save, and a
dcp.async_save; 2 ranks load them back with dcp.load, resharded; one
process reads them with cairn.load / cairn.load_all and the reference
safetensors package. Non-tensor state and bad input run in one process."""

import pathlib
import urllib.parse

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import cairn
import cairn.torch
from conftest import data_files, flip_byte
from gloo_jobs import init, make_model, run, shard

# dcp.save / dcp.load in one process warn that torch.distributed is off.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OBJECTS = {"epoch": 3, "loss": 0.25, "done": False, "tag": "run-7",
           "cfg": {"dropout": None, "sizes": [4, 8]}, "pair": (1, "a"),
           "big": 1 << 70}


def blank_objects():
    """Destinations for OBJECTS: of the same nesting, other values."""
    return {"epoch": 0, "loss": 0.0, "done": True, "tag": "",
            "cfg": {"dropout": 1, "sizes": [0, 0]}, "pair": None,
            "big": None}




def train(model, opt, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def flat(sd, prefix=""):
    """Tensors (DTensors gathered) and other leaves by dotted FQN."""
    out = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(sd, list) and any(isinstance(v, (dict, torch.Tensor))
                                      for v in sd):
        for i, v in enumerate(sd):
            out.update(flat(v, f"{prefix}{i}."))
    elif isinstance(sd, DTensor):
        out[prefix[:-1]] = sd.full_tensor().detach().clone()
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = sd.detach().clone()
    else:
        out[prefix[:-1]] = sd
    return out


def assert_same(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v and type(got[k]) is type(v), (k, got[k], v)


def fsdp_state(world):
    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def full_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "objects": dict(OBJECTS)}


def grid():
    g = torch.Generator().manual_seed(7)
    return torch.randn(10, 7, generator=g)



def save_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    # 1. FSDP2 + AdamW through the plugin.
    model, opt = fsdp_state(world)
    train(model, opt, 2)
    sd = full_state(model, opt)
    dcp.save(sd, storage_writer=cairn.torch.StorageWriter(out / "fsdp"))
    reference = flat(sd)
    # 2. DTensors on a 2-d mesh (uneven Shard on both dims) by cairn.save.
    mesh = init_device_mesh("cpu", (2, 2))
    cairn.save({"grid": distribute_tensor(grid(), mesh, [Shard(0), Shard(1)]),
                "step": 11}, out / "native")
    # 3. dcp.async_save: the checkpoint holds the values at the call.
    a = distribute_tensor(grid(), init_device_mesh("cpu", (world,)),
                          [Shard(0)])
    plain = torch.arange(6.0)
    response = dcp.async_save(
        {"a": a, "plain": plain},
        storage_writer=cairn.torch.StorageWriter(out / "async"))
    a.to_local().fill_(-1.0)
    plain.fill_(-1.0)
    (response.upload_completion if hasattr(response, "upload_completion")
     else response).result()
    # Ranks 1-3 have nothing to write (DCP's default planner writes plain
    # tensors and objects from the coordinator only).
    dcp.save({"w": torch.arange(5), "n": 1},
             storage_writer=cairn.torch.StorageWriter(out / "only0"))
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.destroy_process_group()


def load_job(rank, world, port, out):
    init(rank, world, port)
    out = pathlib.Path(out)
    model, opt = fsdp_state(world)
    torch.manual_seed(123 + rank)  # the loaded values must replace these
    for p in model.parameters():
        p.data.normal_()
    sd = full_state(model, opt)
    sd["objects"] = blank_objects()
    dcp.load(sd, storage_reader=cairn.torch.StorageReader(out / "fsdp"))
    set_state_dict(model, opt, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    got = flat(full_state(model, opt) | {"objects": sd["objects"]})
    assert_same(got, torch.load(out / "reference.pt", weights_only=False))
    # cairn.save's DTensors, resharded by columns and by rows.
    mesh = init_device_mesh("cpu", (world,))
    for placement in (Shard(1), Shard(0)):
        dst = {"grid": distribute_tensor(torch.zeros(10, 7), mesh,
                                         [placement]), "step": 0}
        dcp.load(dst, storage_reader=cairn.torch.StorageReader(
            out / "native"))
        assert torch.equal(dst["grid"].full_tensor(), grid())
        assert dst["step"] == 11
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    run(save_job, 4, out)
    return out


def reference(saved):
    return torch.load(saved / "reference.pt", weights_only=False)


def test_plugin_checkpoint_is_a_cairn_checkpoint(saved):
    md = cairn.read_metadata(saved / "fsdp")
    assert md["world_size"] == 4
    assert md["scalars"]["objects.epoch"] == 3
    assert "optim.param_groups.0.lr" in md["scalars"]
    # One folder per rank, merged without copying.
    assert len({p.parent.name for p in data_files(saved / "fsdp")}) == 4


def test_fsdp_saved_by_four_loads_into_two_with_dcp(saved):
    run(load_job, 2, saved)


def test_plugin_checkpoint_loads_with_cairn_in_one_process(saved):
    want = reference(saved)
    everything = cairn.load_all(saved / "fsdp")
    got = flat(everything)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
    assert everything["objects"] == OBJECTS
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = full_state(model, opt)
    sd["objects"] = blank_objects()
    cairn.load(sd, saved / "fsdp")
    set_state_dict(model, opt, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    assert_same(flat(full_state(model, opt) | {"objects": sd["objects"]}),
                want)


def test_async_save_holds_values_from_the_call(saved):
    everything = cairn.load_all(saved / "async")
    assert torch.equal(everything["a"], grid())
    assert torch.equal(everything["plain"], torch.arange(6.0))


def test_ranks_with_empty_plans(saved):
    md = cairn.read_metadata(saved / "only0")
    assert md["world_size"] == 4
    assert torch.equal(cairn.load_all(saved / "only0")["w"], torch.arange(5))


def test_data_files_open_with_safetensors(saved):
    from safetensors import safe_open
    want = reference(saved)
    files = data_files(saved / "fsdp")
    checked = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata()["format"] == "cairn"
            for name in f.keys():
                fqn, _, at = name.partition("@")
                t = f.get_tensor(name)
                if fqn not in want or not isinstance(want[fqn], torch.Tensor):
                    continue  # an object (U8)
                full = want[fqn]
                offsets = [int(o) for o in at.split(",")] if at else \
                    [0] * full.dim()
                box = full
                for d, (o, n) in enumerate(zip(offsets, t.shape)):
                    box = box.narrow(d, o, n)
                assert t.dtype == full.dtype and torch.equal(t, box), name
                checked += 1
    assert checked >= len([v for v in want.values()
                           if isinstance(v, torch.Tensor)])


# -- one process --


def test_objects_round_trip_plugin_to_cairn(ckpt):
    sd = {"w": torch.ones(2, 3), **OBJECTS}
    dcp.save(sd, storage_writer=cairn.torch.StorageWriter(ckpt))
    dst = {"w": torch.zeros(2, 3), **blank_objects()}
    cairn.load(dst, ckpt)
    assert_same(flat(dst), flat(sd))
    everything = cairn.load_all(ckpt)
    assert torch.equal(everything.pop("w"), sd["w"])
    assert everything == OBJECTS


def test_objects_round_trip_cairn_to_dcp(ckpt):
    sd = {"w": torch.ones(2, 3), **OBJECTS}
    cairn.save(sd, ckpt)
    dst = {"w": torch.zeros(2, 3), **blank_objects()}
    dcp.load(dst, storage_reader=cairn.torch.StorageReader(ckpt))
    assert_same(flat(dst), flat(sd))


def test_overwrite(ckpt):
    dcp.save({"w": torch.ones(3)},
             storage_writer=cairn.torch.StorageWriter(ckpt))
    with pytest.raises(dcp.CheckpointException,
                       match="already holds a committed"):
        dcp.save({"w": torch.zeros(3)},
                 storage_writer=cairn.torch.StorageWriter(ckpt,
                                                          overwrite=False))
    dcp.save({"w": torch.full((3,), 2.0)},
             storage_writer=cairn.torch.StorageWriter(ckpt))
    assert torch.equal(cairn.load_all(ckpt)["w"], torch.full((3,), 2.0))


def test_overwrite_false_sees_a_percent_encoded_file_url(tmp_path):
    # The folder's name has a space: its file:// URL says %20. The writer
    # refuses before planning (cairn's own save would refuse later, with
    # another message).
    folder = tmp_path / "a b"
    url = "file://" + urllib.parse.quote(str(folder))
    dcp.save({"w": torch.ones(3)},
             storage_writer=cairn.torch.StorageWriter(url))
    assert torch.equal(cairn.load_all(str(folder))["w"], torch.ones(3))
    with pytest.raises(dcp.CheckpointException,
                       match="committed checkpoint; pass overwrite=True"):
        dcp.save({"w": torch.zeros(3)},
                 storage_writer=cairn.torch.StorageWriter(url,
                                                          overwrite=False))
    assert torch.equal(cairn.load_all(str(folder))["w"], torch.ones(3))


def test_cached_plans_get_fresh_save_ids(ckpt):
    # DCP's plan caching hands the writer the first save's plans again,
    # storage_data (the save id) included.
    ids = set()
    for i in range(3):
        dcp.save({"w": torch.full((3,), float(i))},
                 storage_writer=cairn.torch.StorageWriter(ckpt),
                 planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
        ids.add(cairn.read_metadata(ckpt)["save_id"])
        assert torch.equal(cairn.load_all(ckpt)["w"],
                           torch.full((3,), float(i)))
    assert len(ids) == 3


def test_checkpoint_id_resets_the_path(tmp_path):
    writer = cairn.torch.StorageWriter(tmp_path / "unused")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "a",
             storage_writer=writer)
    dst = {"w": torch.zeros(3)}
    dcp.load(dst, checkpoint_id=tmp_path / "a",
             storage_reader=cairn.torch.StorageReader(tmp_path / "unused"))
    assert torch.equal(dst["w"], torch.ones(3))
    assert not (tmp_path / "unused").exists()


def test_damaged_data_file_fails_the_load(ckpt):
    dcp.save({"w": torch.arange(4096.0)},
             storage_writer=cairn.torch.StorageWriter(ckpt))
    md = cairn.read_metadata(ckpt)
    chunk = md["tensors"]["w"]["chunks"][0]
    flip_byte(ckpt / chunk["file"], chunk["offset"] + 100)
    with pytest.raises(dcp.CheckpointException, match="crc32c mismatch"):
        dcp.load({"w": torch.zeros(4096)},
                 storage_reader=cairn.torch.StorageReader(ckpt))


def test_missing_checkpoint_fails_clearly(ckpt):
    with pytest.raises(dcp.CheckpointException,
                       match="no committed checkpoint at .*ckpt"):
        dcp.load({"w": torch.zeros(3)},
                 storage_reader=cairn.torch.StorageReader(ckpt))


def test_tensors_torch_has_no_dtype_for_are_left_out(tmp_path):
    """A Hugging Face file with an F6 tensor (no torch dtype) beside an F32
    one: DCP loads the F32 one through the plugin, and is warned of the
    F6 one, which its metadata leaves out."""
    import json
    import struct
    w = torch.arange(8, dtype=torch.float32)
    header = {"r": {"dtype": "F6_E3M2", "shape": [2, 8],
                    "data_offsets": [0, 12]},
              "w": {"dtype": "F32", "shape": [8], "data_offsets": [12, 44]}}
    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + bytes(range(12)) +
        w.numpy().tobytes())
    reader = cairn.torch.StorageReader(tmp_path)
    with pytest.warns(UserWarning, match=r"'r' \(F6_E3M2_X4\)"):
        md = reader.read_metadata()
    assert set(md.state_dict_metadata) == {"w"}
    dst = {"w": torch.zeros(8)}
    dcp.load(dst, storage_reader=cairn.torch.StorageReader(tmp_path))
    assert torch.equal(dst["w"], w)


def test_import_cairn_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, cairn; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

