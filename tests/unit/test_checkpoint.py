"""pccl.checkpoint: safetensors files that carry revision, lineage and digests, written atomically
and refused when truncated or altered."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import pccl
from pccl import checkpoint
from pccl.errors import CheckpointError

LINEAGE = pccl.Lineage(bytes(range(16)), 41, bytes(range(16, 32)))


def _state() -> pccl.SharedState:
    rng = np.random.default_rng(3)
    return pccl.SharedState({
        "w": rng.standard_normal((4, 5)).astype(np.float32),
        "b16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
        "h": rng.standard_normal(3).astype(np.float16),
        "d": rng.standard_normal(2).astype(np.float64),
        "step": np.array([12], np.int64),
        "u": np.arange(9, dtype=np.uint8).reshape(3, 3),
        "empty": np.zeros((0, 4), np.int32),
        "rng": pccl.Tensor(np.arange(5, dtype=np.uint32), allow_content_inequality=True),
    }, revision=42, lineage=LINEAGE)


def _same(a: pccl.SharedState, b: pccl.SharedState) -> None:
    assert list(a) == list(b)
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.tobytes() == y.tobytes(), key
        assert a.tensors()[key].allow_content_inequality == b.tensors()[key].allow_content_inequality
    assert a.revision == b.revision and a.lineage == b.lineage


def test_round_trip_keeps_every_dtype_shape_flag_revision_and_lineage(tmp_path) -> None:
    state = _state()
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(state, path)
    _same(state, checkpoint.load(path))


def test_a_state_without_lineage_round_trips_without_one(tmp_path) -> None:
    state = pccl.SharedState({"w": np.ones(3, np.float32)}, revision=0)
    checkpoint.save(state, tmp_path / "c")
    loaded = checkpoint.load(tmp_path / "c")
    assert loaded.lineage is None and loaded.revision == 0


def test_the_reference_safetensors_reader_reads_what_pccl_writes(tmp_path) -> None:
    state = _state()
    path = str(tmp_path / "ckpt.safetensors")
    checkpoint.save(state, path)
    tensors = {k: v for k, v in safetensors.numpy.load_file(path).items() if k != "b16"}
    assert sorted(tensors) == sorted(k for k in state if k != "b16")
    for key, value in tensors.items():
        assert value.dtype == state[key].dtype and value.tobytes() == state[key].tobytes(), key
    b16 = safetensors.torch.load_file(path)["b16"]
    assert b16.dtype == torch.bfloat16 and b16.view(torch.int16).numpy().tobytes() == state["b16"].tobytes()
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(length))["__metadata__"]
    assert meta["pccl.revision"] == "42"
    assert json.loads(meta["pccl.lineage"])["id"] == LINEAGE.id.hex()


def test_pccl_reads_what_the_reference_writer_writes_when_asked_to_skip_verification(tmp_path) -> None:
    path = str(tmp_path / "plain.safetensors")
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7], np.int16)}
    safetensors.numpy.save_file(arrays, path)
    with pytest.raises(CheckpointError, match="not a pccl checkpoint"):
        checkpoint.load(path)
    loaded = checkpoint.load(path, verify=False)
    assert loaded.revision == 0 and loaded.lineage is None
    for key, value in arrays.items():
        assert loaded[key].tobytes() == value.tobytes() and loaded[key].shape == value.shape


def test_load_into_writes_in_place_into_torch_parameters(tmp_path) -> None:
    src = torch.nn.Linear(3, 2)
    state = pccl.SharedState({n: p.detach() for n, p in src.named_parameters()}, revision=7, lineage=LINEAGE)
    checkpoint.save(state, tmp_path / "c")
    dst = torch.nn.Linear(3, 2)
    target = pccl.SharedState({n: p.detach() for n, p in dst.named_parameters()})
    weight = dst.weight
    assert checkpoint.load(tmp_path / "c", into=target) is target
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    assert dst.weight is weight  # the model's own parameter, written in place
    assert target.revision == 7 and target.lineage == LINEAGE


def test_load_into_a_state_of_another_shape_names_the_tensor_and_changes_nothing(tmp_path) -> None:
    checkpoint.save(pccl.SharedState({"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}, 3), tmp_path / "c")
    w = np.zeros(5, np.float32)
    target = pccl.SharedState({"w": w, "b": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor 'w' is float32\[4\], the state's is float32\[5\]"):
        checkpoint.load(tmp_path / "c", into=target)
    missing = pccl.SharedState({"w": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match="holds tensor 'b'"):
        checkpoint.load(tmp_path / "c", into=missing)
    assert not w.any() and target.revision == 0 and not missing["w"].any()


@pytest.mark.parametrize("cut", [3, 8, 20, "data", 1])
def test_a_truncated_checkpoint_is_refused_naming_the_file(tmp_path, cut) -> None:
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(_state(), path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    size = {3: 3, 8: 8, 20: 20, "data": 8 + length + 10, 1: len(raw) - 1}[cut]
    path.write_bytes(raw[:size])
    with pytest.raises(CheckpointError, match="truncated") as info:
        checkpoint.load(path)
    assert str(path) in str(info.value)
    if cut in ("data", 1):
        assert "tensor '" in str(info.value)


def test_a_bit_flip_in_any_tensor_is_refused_naming_the_tensor_and_leaves_the_target_alone(tmp_path) -> None:
    state = _state()
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(state, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    start = 8 + length
    for key in state:
        begin, end = header[key]["data_offsets"]
        if begin == end:
            continue
        for into in (None, "fresh"):
            flipped = bytearray(raw)
            flipped[start + (begin + end) // 2] ^= 0x10
            path.write_bytes(bytes(flipped))
            target = None
            if into:
                target = pccl.SharedState({k: np.zeros_like(state[k]) for k in state})
            with pytest.raises(CheckpointError, match=f"tensor '{key}' does not match its recorded digest") as info:
                checkpoint.load(path, into=target)
            assert str(path) in str(info.value)
            if target is not None:
                assert all(not target[k].view(np.uint8).any() for k in target) and target.revision == 0


def test_a_damaged_header_or_record_is_a_checkpoint_error(tmp_path) -> None:
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(_state(), path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])

    def write(h: dict) -> None:
        body = json.dumps(h).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length :])

    path.write_bytes(struct.pack("<Q", 2**40) + raw[8:])
    with pytest.raises(CheckpointError, match="announces"):
        checkpoint.load(path)
    path.write_bytes(raw[:8] + b"\xff" + raw[9:])
    with pytest.raises(CheckpointError, match="damaged header"):
        checkpoint.load(path)
    def refused(change, match: str) -> None:
        bad = json.loads(json.dumps(header))
        change(bad)
        write(bad)
        with pytest.raises(CheckpointError, match=match):
            checkpoint.load(path)

    refused(lambda h: h["__metadata__"].update({"pccl.lineage": '{"id": "zz"}'}), "damaged pccl record")
    refused(lambda h: h["__metadata__"].update({"pccl.format_version": "99"}), "format version 99")
    refused(lambda h: h["w"].update(dtype="F8_E4M3"), "tensor 'w' has a damaged entry")
    refused(lambda h: h["w"].update(shape=[5, 5]), "tensor 'w' has a damaged entry")
    refused(lambda h: h["__metadata__"].pop("pccl.xxh3_128"), "damaged pccl record")
    path.write_bytes(raw + b"extra")
    with pytest.raises(CheckpointError, match="after its last tensor"):
        checkpoint.load(path)


def test_a_missing_file_or_directory_is_a_checkpoint_error(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        checkpoint.save(_state(), tmp_path / "no" / "such" / "dir" / "c")
    with pytest.raises(pccl.InvalidArgument):
        checkpoint.save({"w": np.ones(2)}, tmp_path / "c")  # type: ignore[arg-type]
    for bad in (None, 3, b"bytes", ""):
        with pytest.raises(pccl.InvalidArgument, match="checkpoint path"):
            checkpoint.save(_state(), bad)  # type: ignore[arg-type]
        with pytest.raises(pccl.InvalidArgument, match="checkpoint path"):
            checkpoint.load(bad)  # type: ignore[arg-type]


def test_save_replaces_atomically_and_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    old = pccl.SharedState({"w": np.ones(4, np.float32)}, revision=1)
    checkpoint.save(old, path)
    before = path.read_bytes()
    new = pccl.SharedState({"w": np.full(4, 2, np.float32)}, revision=2)

    def crash(src, dst):  # the process dies between writing the new file and renaming it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match="No space left"):
        checkpoint.save(new, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    checkpoint.save(new, path)
    assert checkpoint.load(path).revision == 2 and os.listdir(tmp_path) == ["ckpt.safetensors"]
