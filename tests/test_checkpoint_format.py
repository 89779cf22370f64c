"""The snapshot format: nested states round-trip exactly; bad manifests are rejected, never executed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainguard.checkpoint.format import (
    FORMAT,
    FormatError,
    decode_manifest,
    encode_manifest,
    flatten,
    parse_entries,
    plan_layout,
    tensor_view,
    unflatten,
)


def roundtrip(state):
    tree, tensors = flatten(state)
    entries, size = plan_layout(tensors)
    buf = torch.zeros(size, dtype=torch.uint8)
    for e, t in zip(entries, tensors, strict=True):
        if e.nbytes:
            buf[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t)
    raw = encode_manifest(
        {"format": FORMAT, "step": 1, "tree": tree, "tensors": [e.to_json() for e in entries]}
    )
    meta = decode_manifest(raw)
    return unflatten(meta["tree"], [tensor_view(buf, e) for e in parse_entries(meta["tensors"], size)])


def assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a,
            b.view(torch.uint8) if b.dtype == torch.bool else b,
        )
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_checkpoint_model_and_adam_state_roundtrip():
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    back = roundtrip(state)
    assert_same(state, back)
    assert all(isinstance(k, int) for k in back["optim"]["state"])  # int keys stay ints
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)
    model2 = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 1))
    model2.load_state_dict(back["model"])
    torch.optim.AdamW(model2.parameters()).load_state_dict(back["optim"])


def test_checkpoint_odd_values_roundtrip():
    state = {
        "scalars": [None, True, False, 0, -(2**62), 1.5, float("inf"), float("nan"), "x\u00e9"],
        "tuple": (1, (2, [3])),
        "dtypes": [torch.bfloat16, torch.int8, torch.device("cpu")],
        "tensors": [
            torch.tensor(3.5),  # 0-d
            torch.empty(0, 4),  # empty
            torch.arange(12).view(3, 4).t(),  # non-contiguous
            torch.randn(5, dtype=torch.bfloat16),
            torch.randn(3, dtype=torch.complex64),
            torch.tensor([True, False, True]),
            torch.arange(7, dtype=torch.uint8),
        ],
        7: "int key",
    }
    assert_same(state, roundtrip(state))


def test_checkpoint_layout_is_aligned():
    _, tensors = flatten([torch.ones(3, dtype=torch.int8), torch.ones(5, dtype=torch.float64)])
    entries, size = plan_layout(tensors)
    assert [e.offset % 64 for e in entries] == [0, 0]
    assert entries[1].offset >= 3 and size >= entries[1].offset + 40


@pytest.mark.parametrize("bad", [object(), b"bytes", {1.5: 1}, {(1, 2): 3}, torch.randn(3).to_sparse()])
def test_checkpoint_rejects_values_it_cannot_store_without_pickle(bad):
    with pytest.raises(TypeError):
        flatten({"x": bad})


def _manifest(tensors, tree=None):
    return {"format": FORMAT, "step": 1, "tree": tree or {"T": 0}, "tensors": tensors}


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "load", "shape": [1], "offset": 0, "nbytes": 4},  # a torch function, not a dtype
        {"dtype": "__class__", "shape": [1], "offset": 0, "nbytes": 4},
        {"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 8},  # size mismatch
        {"dtype": "float32", "shape": [64], "offset": 0, "nbytes": 256},  # beyond the data
        {"dtype": "float32", "shape": [1], "offset": 3, "nbytes": 4},  # unaligned
        {"dtype": "float32", "shape": [-1], "offset": 0, "nbytes": -4},
        {"shape": [1]},
    ],
)
def test_checkpoint_rejects_bad_tensor_entries(entry):
    with pytest.raises(FormatError):
        parse_entries([entry], 128)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"format": "other"}',
        encode_manifest({"format": FORMAT, "tree": 1, "tensors": []}),
    ],
)
def test_checkpoint_rejects_bad_manifests(raw):
    with pytest.raises(FormatError):
        decode_manifest(raw)


@pytest.mark.parametrize("tree", [{"T": 5}, {"X": 1}, {"D": [[1.5, 2]]}, {"L": 3}, {"dtype": "Tensor"}])
def test_checkpoint_rejects_bad_trees(tree):
    with pytest.raises(FormatError):
        unflatten(tree, [torch.zeros(1)])
