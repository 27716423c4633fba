"""One process: every dtype, NumPy and torch, scalars and objects, and the
files as the reference safetensors package reads them."""

import json
import pickle

import numpy as np
import pytest
import torch
from safetensors import safe_open

import cairn
from conftest import data_files

TORCH_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
                torch.int32, torch.int16, torch.int8, torch.uint64,
                torch.uint32, torch.uint16, torch.uint8, torch.bool]
NUMPY_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32,
                np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8,
                np.bool_]


def random_bits(dtype, shape, seed):
    """A tensor of `dtype` with random bit patterns (every byte exercised;
    NaN patterns included for floats, which bit-exact compares must keep)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8),
                       b.contiguous().view(torch.uint8))


class Point:
    """A picklable object leaf."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def test_version():
    assert cairn.__version__ == "0.1.0"
    assert cairn.FORMAT_VERSION == 6


def test_every_torch_dtype_round_trips_bit_exact(ckpt):
    src = {str(d).removeprefix("torch."): random_bits(d, (5, 7), i)
           for i, d in enumerate(TORCH_DTYPES)}
    saved = cairn.save({"t": src}, ckpt)
    assert saved.data_bytes == sum(t.numel() * t.element_size()
                                   for t in src.values())
    dst = {"t": {k: torch.zeros_like(v) for k, v in src.items()}}
    result = cairn.load(dst, ckpt)
    assert result.bytes_unverified == 0
    assert result.bytes_verified == saved.data_bytes
    for k, v in src.items():
        assert dst["t"][k].dtype == v.dtype
        assert same_bits(dst["t"][k], v), k
    everything = cairn.load_all(ckpt)
    for k, v in src.items():
        assert everything["t"][k].dtype == v.dtype
        assert same_bits(everything["t"][k], v), k


def test_every_numpy_dtype_round_trips(ckpt):
    rng = np.random.default_rng(0)
    src = {}
    for d in NUMPY_DTYPES:
        raw = rng.integers(0, 256, size=4 * 6 * np.dtype(d).itemsize,
                           dtype=np.uint8)
        if d == np.bool_:
            raw %= 2
        src[np.dtype(d).name] = raw.view(d).reshape(4, 6)
    cairn.save(src, ckpt)
    dst = {k: np.zeros_like(v) for k, v in src.items()}
    cairn.load(dst, ckpt)
    back = cairn.load_all(ckpt, framework="numpy")
    for k, v in src.items():
        assert dst[k].tobytes() == v.tobytes(), k
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes()


def test_numpy_load_all_of_bf16_names_the_fix(ckpt):
    cairn.save({"w": torch.ones(3, dtype=torch.bfloat16)}, ckpt)
    try:
        import ml_dtypes  # noqa: F401
        pytest.skip("ml_dtypes is installed: bf16 loads into NumPy")
    except ImportError:
        pass
    with pytest.raises(cairn.InvalidArgumentError, match="'w' is BF16.*torch"):
        cairn.load_all(ckpt, framework="numpy")


def test_strided_sources_and_destinations(ckpt):
    base = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    src = {"t": base.t(), "every_other": base[::2, 1::3]}
    cairn.save(src, ckpt)
    dst_base = torch.zeros(10, 12)
    dst = {"t": dst_base.t().contiguous().t(),  # strided view of fresh memory
           "every_other": torch.zeros(20, 3)[::3, :][:6]}
    assert not dst["t"].is_contiguous()
    cairn.load(dst, ckpt)
    assert torch.equal(dst["t"], src["t"])
    assert torch.equal(dst["every_other"], src["every_other"])


def test_parameters_with_grad_and_zero_dim(ckpt):
    p = torch.nn.Parameter(torch.randn(4, 4))
    step = torch.tensor(7.0)
    cairn.save({"p": p, "step": step, "empty": torch.zeros(0, 3)}, ckpt)
    q = torch.nn.Parameter(torch.zeros(4, 4))
    dst = {"p": q, "step": torch.tensor(0.0), "empty": torch.ones(0, 3)}
    cairn.load(dst, ckpt)
    assert torch.equal(q.detach(), p.detach()) and q.requires_grad
    assert dst["step"].item() == 7.0


def test_sharded_tensors_by_hand(ckpt):
    # Torch shards take the extension's own path; a shard that is a NumPy
    # array sends the whole leaf through the Python layer's. Both store the
    # same boxes, and load fills the locals in place.
    full = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
    top, bottom = full[:2].clone(), full[2:].clone()
    f8 = torch.arange(8, dtype=torch.float32).to(torch.float8_e4m3fn)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    src = {"by_torch": cairn.ShardedTensor([6, 4], [((0, 0), top),
                                                   ((2, 0), bottom)]),
           "f8": cairn.ShardedTensor([8], [((0,), f8)]),
           "mixed": cairn.ShardedTensor([6, 4], [
               ((0, 0), torch.from_numpy(rows.copy())), ((3, 0), rows + 12)])}
    cairn.save(src, ckpt)
    back = cairn.load_all(ckpt)
    assert torch.equal(back["by_torch"].view(torch.int16),
                       full.view(torch.int16))
    assert torch.equal(back["f8"].view(torch.uint8), f8.view(torch.uint8))
    assert torch.equal(back["mixed"], torch.arange(24.0).reshape(6, 4))
    mid = torch.zeros(3, 4, dtype=torch.bfloat16)
    cols = np.zeros((6, 2), dtype=np.float32)
    cairn.load({"by_torch": cairn.ShardedTensor([6, 4], [((1, 0), mid)]),
                "mixed": cairn.ShardedTensor([6, 4], [((0, 2), cols)])},
               ckpt, strict=False)
    assert torch.equal(mid.view(torch.int16), full[1:4].view(torch.int16))
    assert cols.tolist() == np.arange(24.0).reshape(6, 4)[:, 2:].tolist()


def test_plain_tensors_skip_the_python_walk(ckpt, monkeypatch):
    # The extension converts plain tensors, Parameters and ShardedTensors of
    # them itself (no interpreted code per tensor: in a job whose ranks are
    # threads, that time adds up across ranks); only other leaves reach the
    # Python layer's tensor_leaf.
    seen = []
    real = cairn._state.tensor_leaf

    def spy(x, fqn):
        seen.append(fqn)
        return real(x, fqn)

    monkeypatch.setattr(cairn._state, "tensor_leaf", spy)
    state = {"w": torch.ones(3), "p": torch.nn.Parameter(torch.ones(2)),
             "s": cairn.ShardedTensor([4], [((0,), torch.ones(4))]),
             "a": np.ones(2), "obj": None, "n": 3}
    cairn.save(state, ckpt)
    cairn.load(state, ckpt)
    assert seen == ["a", "obj", "a", "obj"]


def test_memory_budget_is_a_load_option(ckpt):
    src = {"w": torch.arange(4096.0).reshape(64, 64), "step": 3}
    cairn.save(src, ckpt)
    for budget in (0, 1, 1 << 20):
        dst = {"w": torch.zeros(64, 64), "step": 0}
        cairn.load(dst, ckpt, memory_budget_bytes=budget)
        assert torch.equal(dst["w"], src["w"]) and dst["step"] == 3
    with pytest.raises(TypeError, match="'memory_budget_bytes' does not take a str"):
        cairn.load({"w": torch.zeros(64, 64)}, ckpt, memory_budget_bytes="big")


def test_values_in_lists_are_put_back(ckpt):
    src = {"groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
           "hist": [1, "two", 3.0, None]}
    cairn.save(src, ckpt)
    dst = {"groups": [{"lr": 0.0, "params": [9, 9]}, {"lr": 0.0, "params": [9]}],
           "hist": [0, "", 0.0, 0]}
    cairn.load(dst, ckpt)
    assert dst == src


def test_scalars_bytes_and_objects(ckpt):
    src = {
        "step": 100, "lr": 3e-4, "done": False, "name": "run-7",
        "raw": b"\x01\x02\x03", "tricky": cairn._state.PICKLE_MAGIC + b"x",
        "none": None, "betas": (0.9, 0.95), "point": Point(3),
        "big": 1 << 70, "layers": [{"w": torch.ones(2)}, {"w": torch.zeros(2)}],
    }
    cairn.save(src, ckpt)
    md = cairn.read_metadata(ckpt)
    assert md["scalars"] == {"step": 100, "lr": 3e-4, "done": False,
                             "name": "run-7"}
    assert set(md["objects"]) == {"raw", "tricky", "none", "betas", "point",
                                  "big"}
    dst = {"step": 0, "lr": 0.0, "done": True, "name": "", "raw": b"",
           "tricky": b"", "none": 1, "betas": (0, 0), "point": None, "big": 0,
           "layers": [{"w": torch.empty(2)}, {"w": torch.empty(2)}]}
    cairn.load(dst, ckpt)
    for k in ("step", "lr", "done", "name", "raw", "tricky", "none", "betas",
              "point", "big"):
        assert dst[k] == src[k], k
    assert torch.equal(dst["layers"][1]["w"], torch.zeros(2))
    back = cairn.load_all(ckpt)
    assert back["betas"] == (0.9, 0.95) and back["point"] == Point(3)
    assert isinstance(back["layers"], list) and len(back["layers"]) == 2
    raw = cairn.load_all(ckpt, allow_pickle=False)
    assert raw["point"].startswith(cairn._state.PICKLE_MAGIC)
    assert pickle.loads(raw["point"][len(cairn._state.PICKLE_MAGIC):]) == Point(3)


def test_result_reports_bytes_and_phases(ckpt):
    saved = cairn.save({"w": torch.zeros(1024, 256)}, ckpt,
                       user_metadata={"step": 3})
    assert saved.data_bytes == 1024 * 256 * 4
    assert saved.files == 1 and saved.world_size == 1
    p = saved.phases
    assert p.write > 0
    assert p.planning + p.prepare + p.write + p.commit <= saved.seconds + 1e-9
    md = cairn.read_metadata(ckpt)
    assert md["user"] == {"step": 3}
    assert md["save_id"] and md["tensors"]["w"]["shape"] == [1024, 256]
    loaded = cairn.load({"w": torch.empty(1024, 256)}, ckpt)
    assert loaded.phases.read >= 0 and loaded.seconds > 0


def test_reference_safetensors_reads_every_file(ckpt):
    src = {"a": random_bits(torch.bfloat16, (8, 3), 1),
           "b": random_bits(torch.float8_e4m3fn, (4,), 2),
           "c": torch.arange(6, dtype=torch.int32).reshape(2, 3),
           "d": random_bits(torch.bool, (9,), 3)}
    cairn.save(src, ckpt)
    files = data_files(ckpt)
    assert files
    md = cairn.read_metadata(ckpt)
    seen = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                fqn = next(fqn for fqn, tm in md["tensors"].items()
                           if any(c["file"] == f.name for c in tm["chunks"])
                           and key.startswith(fqn))
                assert t.dtype == src[fqn].dtype
                assert same_bits(t, src[fqn])
                seen += 1
    assert seen == len(src)


def test_plan_cache_hits_on_the_second_save(tmp_path):
    cache = cairn.SavePlanCache()
    sd = {"w": torch.ones(16, 16)}
    first = cairn.save(sd, tmp_path / "a", plan_cache=cache)
    second = cairn.save(sd, tmp_path / "b", plan_cache=cache)
    assert not first.plan_cache_hit and second.plan_cache_hit


def test_rank_local_save_and_merge(ckpt):
    sd = {"w": torch.arange(10.0)}
    cairn.save(sd, ckpt, rank_local=True)
    merged = cairn.merge(ckpt)
    assert merged["ranks"] == 1 and merged["data_bytes"] == 40
    dst = {"w": torch.zeros(10)}
    cairn.load(dst, ckpt)
    assert torch.equal(dst["w"], sd["w"])


def test_metadata_user_is_json(ckpt):
    cairn.save({"x": 1}, ckpt, user_metadata=json.dumps({"a": [1, 2]}))
    assert cairn.read_metadata(ckpt)["user"] == {"a": [1, 2]}


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine (CUDA tests run "
                           "where a GPU is lent)")
def test_cuda_tensors_round_trip(ckpt):
    src = {"w": random_bits(torch.bfloat16, (256, 128), 4).cuda(),
           "f8": random_bits(torch.float8_e4m3fn, (64,), 5).cuda(),
           "host": torch.arange(5)}
    cairn.save(src, ckpt)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    result = cairn.load(dst, ckpt)
    assert result.device_bytes == (256 * 128 * 2 + 64)
    for k in src:
        assert same_bits(dst[k].cpu(), src[k].cpu()), k
