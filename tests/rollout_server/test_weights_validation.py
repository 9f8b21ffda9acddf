"""Parsing and validation of weight updates, before anything reaches a model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save, save_file

from rollout_server.engine.base import TensorMeta, WeightsError
from rollout_server.errors import Conflict, NotFound
from rollout_server.finite import non_finite_buckets
from rollout_server.weights.staging import WeightStager
from rollout_server.weights.validation import (
    parse_safetensors,
    read_safetensors_path,
    validate_tensors,
)

META = {
    "model.embed_tokens.weight": TensorMeta("float32", (10, 4)),
    "model.norm.weight": TensorMeta("float32", (4,)),
}


def _good() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.ones(10, 4), "model.norm.weight": torch.ones(4)}


def test_a_valid_blob_round_trips_and_reports_its_bytes():
    tensors = parse_safetensors(save(_good()))
    assert validate_tensors(tensors, META) == (40 + 4) * 4
    assert torch.equal(tensors["model.norm.weight"], torch.ones(4))


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "is empty"),
        (b"not safetensors at all", "not a valid safetensors"),
        (save(_good())[:-7], "not a valid safetensors"),  # truncated payload
    ],
)
def test_bad_blobs_are_refused(blob, message):
    with pytest.raises(WeightsError, match=message):
        parse_safetensors(blob)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            {"model.norm.weigth": torch.ones(4)},
            "unknown tensor 'model.norm.weigth'.*did you mean 'model.norm.weight'",
        ),
        ({"model.norm.weight": torch.ones(5)}, r"shape \[5\], the model's is \[4\]"),
        (
            {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)},
            "dtype bfloat16, the model's is float32",
        ),
        ({}, "no tensors"),
    ],
)
def test_validation_names_the_problem(tensors, message):
    with pytest.raises(WeightsError, match=message):
        validate_tensors(tensors, META)


def test_validation_lists_every_bad_tensor():
    bad = {f"x{i}": torch.ones(1) for i in range(7)}
    with pytest.raises(WeightsError, match="and 2 more problems"):
        validate_tensors(bad, META)


def test_non_finite_values_are_refused_by_tensor_name():
    nan_norm = torch.tensor([1.0, float("nan"), float("nan"), 2.0])
    inf_embed = torch.ones(10, 4)
    inf_embed[3, 1] = float("-inf")
    with pytest.raises(WeightsError) as err:
        validate_tensors(
            {"model.norm.weight": nan_norm, "model.embed_tokens.weight": inf_embed}, META
        )
    assert "tensor 'model.norm.weight' holds 2 non-finite values (NaN or inf) of 4" in str(
        err.value
    )
    assert "tensor 'model.embed_tokens.weight' holds 1 non-finite values" in str(err.value)
    # values already scanned (staged buckets at commit) are not scanned again
    assert validate_tensors({"model.norm.weight": nan_norm}, META, check_values=False) == 16
    # a bucket is scanned on arrival
    stager = WeightStager()
    uid = stager.begin(version=None)
    with pytest.raises(WeightsError, match=r"'model\.norm\.weight' holds 2 non-finite"):
        stager.add_bucket(uid, 0, {"model.norm.weight": nan_norm}, META)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_non_finite_values_are_found_in_every_float_dtype(dtype):
    meta = {"w": TensorMeta(str(dtype).removeprefix("torch."), (3,))}
    assert (
        validate_tensors({"w": torch.ones(3).to(dtype)}, meta)
        == 3 * torch.ones(3).to(dtype).element_size()
    )
    bad = torch.tensor([1.0, float("nan"), 1.0]).to(dtype)
    with pytest.raises(WeightsError, match="'w' holds 1 non-finite"):
        validate_tensors({"w": bad}, meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_nccl_and_ipc_buckets_are_scanned_by_tensor_name(dtype):
    """What the vLLM workers run on the flat buckets of an NCCL or CUDA IPC update before
    loading it (on the GPU there)."""
    from rollout_server.nccl_wire import bucket_layout

    specs = [
        {"name": "a", "shape": [2, 3]},
        {"name": "b", "shape": [4]},
        {"name": "c", "shape": [5]},
        {"name": "steps", "shape": [2]},
    ]
    name = str(dtype).removeprefix("torch.")
    layout = bucket_layout(specs, [[0, 1], [2], [3]], [name, name, "int64"])
    flats = [torch.ones(10).to(dtype), torch.ones(5).to(dtype), torch.tensor([1, 2])]
    assert non_finite_buckets(flats, layout) == ""
    flats[0][7] = float("nan")  # b[1]
    flats[1][0] = float("inf") if dtype == torch.bfloat16 else float("nan")  # e4m3fn: no inf
    problem = non_finite_buckets(flats, layout)
    assert "tensor 'b' holds 1 non-finite values (NaN or inf) of 4" in problem
    assert "tensor 'c' holds 1 non-finite" in problem and "'a'" not in problem


def test_integer_tensors_are_not_scanned():
    meta = {"steps": TensorMeta("int64", (2,))}
    assert validate_tensors({"steps": torch.tensor([1, 2])}, meta) == 16


def test_files_and_directories(tmp_path):
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "a.safetensors")
    save_file({"model.embed_tokens.weight": torch.ones(10, 4)}, tmp_path / "b.safetensors")
    assert set(read_safetensors_path(str(tmp_path))) == set(META)
    assert set(read_safetensors_path(str(tmp_path / "a.safetensors"))) == {"model.norm.weight"}
    with pytest.raises(WeightsError, match="no such file"):
        read_safetensors_path(str(tmp_path / "missing.safetensors"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match=r"no \.safetensors files"):
        read_safetensors_path(str(tmp_path / "empty"))
    (tmp_path / "trunc.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes()[:-9])
    with pytest.raises(WeightsError, match="cannot read"):
        read_safetensors_path(str(tmp_path / "trunc.safetensors"))


def test_stager_collects_buckets_and_commits_only_when_complete():
    stager = WeightStager()
    uid = stager.begin(version=None)
    stager.add_bucket(uid, 1, {"model.norm.weight": torch.ones(4)}, META)
    with pytest.raises(Conflict, match=r"missing buckets \[0\]"):
        stager.take_complete(uid, 2)
    with pytest.raises(WeightsError, match="already sent in bucket 1"):
        stager.add_bucket(uid, 0, {"model.norm.weight": torch.ones(4)}, META)
    with pytest.raises(WeightsError, match="unknown tensor"):
        stager.add_bucket(uid, 0, {"nope": torch.ones(4)}, META)
    stager.add_bucket(uid, 0, {"model.embed_tokens.weight": torch.zeros(10, 4)}, META)
    # a retried upload of the same bucket replaces it
    stager.add_bucket(uid, 0, {"model.embed_tokens.weight": torch.ones(10, 4)}, META)
    with pytest.raises(Conflict, match=r"beyond num_buckets"):
        stager.take_complete(uid, 1)
    update = stager.take_complete(uid, 2)
    assert set(update.tensors()) == set(META)
    assert torch.equal(update.tensors()["model.embed_tokens.weight"], torch.ones(10, 4))
    with pytest.raises(NotFound, match="no open weight update"):
        stager.get(uid)  # committed: closed


def test_a_new_begin_supersedes_the_open_update():
    stager = WeightStager()
    old = stager.begin(version=None)
    new = stager.begin(version=None)
    with pytest.raises(NotFound, match="superseded"):
        stager.add_bucket(old, 0, {"model.norm.weight": torch.ones(4)}, META)
    stager.abort(new)
    with pytest.raises(NotFound):
        stager.abort(new)
