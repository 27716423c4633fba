"""Bad input: clear exceptions that keep cairn's message, never a crash, and
destinations left alone where the library promises it."""

import os

import numpy as np
import pytest
import torch

import cairn
from conftest import data_files, flip_byte


@pytest.fixture
def saved(ckpt):
    cairn.save({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
                "step": 5, "blob": {"k": [1, 2]}}, ckpt)
    return ckpt


def test_exception_classes_are_builtin_kinds_too():
    assert issubclass(cairn.DataLossError, cairn.Error)
    assert issubclass(cairn.NotFoundError, LookupError)
    assert issubclass(cairn.AlreadyExistsError, FileExistsError)
    assert issubclass(cairn.DeadlineExceededError, TimeoutError)
    assert issubclass(cairn.InvalidArgumentError, ValueError)


def test_no_checkpoint(tmp_path):
    with pytest.raises(cairn.NotFoundError, match="metadata.json"):
        cairn.load({"w": torch.zeros(1)}, tmp_path / "nothing")
    with pytest.raises(cairn.NotFoundError):
        cairn.read_metadata(tmp_path / "nothing")


def test_saving_over_a_checkpoint_needs_overwrite(saved):
    with pytest.raises(FileExistsError, match="overwrite"):
        cairn.save({"w": torch.zeros(1)}, saved)
    cairn.save({"w": torch.zeros(1)}, saved, overwrite=True)
    assert cairn.read_metadata(saved)["tensors"]["w"]["shape"] == [1]


def test_damaged_data_file_is_data_loss(saved):
    (f,) = data_files(saved)
    md = cairn.read_metadata(saved)
    offset = md["tensors"]["w"]["chunks"][0]["offset"]
    flip_byte(f, offset + 17)
    dst = {"w": torch.zeros(8, 8)}
    with pytest.raises(cairn.DataLossError, match=r"'?w'?.*" + f.name):
        cairn.load(dst, saved)
    with pytest.raises(cairn.DataLossError):
        cairn.load_all(saved)


def test_damaged_metadata_is_data_loss(saved):
    meta = saved / "metadata.json"
    text = meta.read_bytes()
    meta.write_bytes(text.replace(b'"step"', b'"stap"', 1))
    with pytest.raises(cairn.DataLossError, match="metadata.json"):
        cairn.read_metadata(saved)


def test_truncated_data_file(saved):
    (f,) = data_files(saved)
    os.truncate(f, 4096 + 10)
    with pytest.raises(cairn.DataLossError):
        cairn.load({"w": torch.zeros(8, 8)}, saved)


def test_wrong_shape_or_dtype_writes_nothing(saved):
    dst = {"w": torch.full((8, 4), 7.0), "step": 0}
    with pytest.raises(cairn.FailedPreconditionError, match="'?w'?.*shape"):
        cairn.load(dst, saved)
    assert torch.equal(dst["w"], torch.full((8, 4), 7.0))
    assert dst["step"] == 0  # scalars are put back only after success
    dst = {"w": torch.full((8, 8), 7, dtype=torch.int32)}
    with pytest.raises(cairn.FailedPreconditionError, match="dtype"):
        cairn.load(dst, saved)
    assert torch.equal(dst["w"], torch.full((8, 8), 7, dtype=torch.int32))


def test_missing_key_strict_and_not(saved):
    dst = {"w": torch.zeros(8, 8), "absent": torch.ones(3), "gone": 4}
    with pytest.raises(cairn.NotFoundError, match="absent"):
        cairn.load(dst, saved)
    assert torch.equal(dst["w"], torch.zeros(8, 8))
    result = cairn.load(dst, saved, strict=False)
    assert sorted(result.missing) == ["absent", "gone"]
    assert sorted(result.unexpected) == ["blob.k.0", "blob.k.1", "step"]
    assert dst["gone"] == 4 and torch.equal(dst["absent"], torch.ones(3))
    assert dst["w"][7, 7].item() == 63


def test_unsupported_values_name_the_fqn(ckpt):
    with pytest.raises(cairn.InvalidArgumentError, match="'m.z'.*complex"):
        cairn.save({"m": {"z": torch.zeros(2, dtype=torch.complex128)}}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="keys must be str"):
        cairn.save({"m": {1: torch.zeros(2)}}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="sparse|strided"):
        cairn.save({"s": torch.zeros(3, 3).to_sparse()}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="a state dict is a dict, not Tensor"):
        cairn.save(torch.zeros(2), ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="same FQN|twice|'a.b'"):
        cairn.save({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, ckpt)
    with pytest.raises(TypeError, match="unexpected save option 'bogus'"):
        cairn.save({"x": 1}, ckpt, bogus=1)
    assert not (ckpt / "metadata.json").exists()


def test_bad_sharded_tensors_name_the_fqn(ckpt):
    t = torch.zeros(2, 4)
    with pytest.raises(cairn.InvalidArgumentError, match="'s'.*different dtypes"):
        cairn.save({"s": cairn.ShardedTensor(
            [4, 4], [((0, 0), t), ((2, 0), t.double())])}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="'s'.*offsets"):
        cairn.save({"s": cairn.ShardedTensor([4, 4], [((0,), t)])}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="'s'.*no shards"):
        cairn.save({"s": cairn.ShardedTensor([4, 4], [])}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="'s'.*torch tensor or a NumPy"):
        cairn.save({"s": cairn.ShardedTensor([4, 4], [((0, 0), [1, 2])])}, ckpt)
    with pytest.raises(cairn.InvalidArgumentError, match="'s'.*complex"):
        cairn.save({"s": cairn.ShardedTensor(
            [4], [((0,), torch.zeros(4, dtype=torch.complex128))])}, ckpt)
    assert not (ckpt / "metadata.json").exists()


def test_a_prepared_state_dict_serves_one_call(ckpt):
    from cairn import _cairn, _state
    prepared = _state.Prepared({"w": torch.zeros(2)}, for_load=False)
    _cairn.save(prepared.tree, str(ckpt))
    with pytest.raises(ValueError, match="used already"):
        _cairn.save(prepared.tree, str(ckpt), overwrite=True)
    for_save = _state.Prepared({"w": torch.zeros(2)}, for_load=False)
    with pytest.raises(ValueError, match="prepared for a save"):
        _cairn.load(for_save.tree, str(ckpt))


def test_read_only_numpy_destination_is_refused(saved):
    src = np.zeros((8, 8), dtype=np.float32)
    src.flags.writeable = False
    with pytest.raises(cairn.InvalidArgumentError, match="'w'.*read-only"):
        cairn.load({"w": src}, saved)


def test_read_only_numpy_source_saves(ckpt):
    src = np.arange(6, dtype=np.int16)
    src.flags.writeable = False
    cairn.save({"a": src}, ckpt)
    assert cairn.load_all(ckpt, framework="numpy")["a"].tolist() == list(range(6))


def test_bad_options_are_errors(ckpt):
    with pytest.raises(cairn.InvalidArgumentError, match="crc32c_block_bytes|power of two"):
        cairn.save({"w": torch.zeros(2)}, ckpt, crc32c_block_bytes=1000)
    with pytest.raises(cairn.InvalidArgumentError, match="save id"):
        cairn.save({"w": torch.zeros(2)}, ckpt, save_id="no spaces")
    with pytest.raises(cairn.InvalidArgumentError, match="dedup"):
        cairn.save({"w": torch.zeros(2)}, ckpt, dedup="random")
    with pytest.raises(cairn.InvalidArgumentError, match="framework"):
        cairn.load_all(ckpt, framework="jax")


def test_communicator_errors_become_exceptions(ckpt):
    class Broken:
        def rank(self):
            return 0

        def size(self):
            return 2

        def all_gather(self, data):
            raise RuntimeError("the network is down")

        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError(f"the network is down ({name})")
            return fail

    with pytest.raises(cairn.Error, match="network is down"):
        cairn.save({"w": torch.zeros(2)}, ckpt, comm=Broken())
    assert not (ckpt / "metadata.json").exists()


def test_verify_finds_damage_without_raising(saved):
    calls = []
    report = cairn.verify(saved, progress=lambda done, total: calls.append(
        (done, total)))
    assert report.ok and not report.problems
    assert report.files == 1 and report.bytes_checked >= 64 * 4
    assert calls and calls[-1][0] == calls[-1][1]
    (f,) = data_files(saved)
    offset = cairn.read_metadata(saved)["tensors"]["w"]["chunks"][0]["offset"]
    flip_byte(f, offset + 3)
    report = cairn.verify(saved)
    assert not report.ok
    (problem,) = report.problems
    assert problem.kind == "crc32c" and problem.fqn == "w"
    assert problem.file == f.name and f.name in problem.message


def test_verify_errors(tmp_path, saved):
    with pytest.raises(cairn.NotFoundError):
        cairn.verify(tmp_path / "nothing")
    with pytest.raises(cairn.InvalidArgumentError):
        cairn.verify(saved, io_threads=0)

    def broken(done, total):
        raise ValueError("progress bar fell over")

    with pytest.raises(RuntimeError, match="progress bar fell over"):
        cairn.verify(saved, progress=broken)
