"""Checkpoint faults, each reproduced with real files (and real jobs where the fault needs
one): pruning with unverifiable newer steps, edits to the manifest, crafted files that once
escaped as MemoryError / RecursionError."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from tgtest import EXAMPLE, events

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.format import FORMAT
from trainguard.checkpoint.shm import make_shm_dir, release_shm_dir

SEAL = b"\ntrainguard-manifest-crc32="


@pytest.mark.slow
def test_checkpoint_prune_keeps_new_verified_steps_when_newer_ones_do_not_verify(jobs, tmp_path, shm_root):
    """A run dir whose newer checkpoints were truncated. The reported repro with --ckpt-keep 1
    (one broken newer step is then enough): the rerun used to persist steps 5, 10, 15 and delete
    each at once, pruning kept the highest step number, the broken one, so the next run started at
    step 0."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"

    def train(steps: int, name: str) -> None:
        job = jobs("run", "--standalone", "--nproc-per-node", "1", "--run-dir", run, "--ckpt-shm-dir", shm_root,
                   "--ckpt-keep", "1", "--precheck", "off", "--quiet", EXAMPLE, "--steps", str(steps),
                   "--ckpt-every", "5", "--ckpt", "trainguard", name=name)
        assert job.wait() == 0, job.output()

    train(30, "first")
    assert disk.list_steps(ckpt, 0) == [30]
    os.truncate(disk.step_dir(ckpt, 30) / disk.data_name(0), 100)
    train(15, "second")
    assert disk.list_steps(ckpt, 0) == [15]  # the newest verified checkpoint is kept
    moved = sorted(p.name for p in ckpt.glob("quarantine/step-0000000030.*/*"))
    assert moved == ["rank-00000.bin", "rank-00000.json"]  # moved aside, not deleted
    [q] = events(run, "checkpoint_quarantined")
    assert q.evidence["steps"] == [30] and q.severity.label == "warning"
    assert "100 bytes" in q.evidence["errors"]["30"]
    got, fallbacks = load(ckpt, shm_root)  # what the next run resumes from (it used to be nothing)
    assert got["step"] == 15 and not fallbacks


# --- manifests -----------------------------------------------------------------------------------------
def two_steps(tmp_path: Path, shm_root: Path) -> Path:
    """Steps 1 and 2 of rank 0 persisted (by the local-mode persister), on real files."""
    ckpt = tmp_path / "ckpt"
    shm = make_shm_dir(shm_root)
    ck = Checkpointer(shm, ckpt, 0, 1)
    try:
        for step in (1, 2):
            state = {"w": torch.full((4, 3), float(step)), "optim": {"lr": 0.1 * step}, "step": step}
            assert ck.save(state, step)
            ck.wait()  # the overlapped copy is done: the snapshot is complete
            from trainguard.checkpoint.persist import Persister

            Persister(shm, ckpt, 3, lambda *a, **k: None).run_pass()
    finally:
        ck.close()
        release_shm_dir(shm)
    return ckpt


def load(ckpt: Path, shm_root: Path) -> tuple[dict | None, list[dict]]:
    """Resume as a fresh process on a replaced node would: no shared memory, only the disk."""
    shm = make_shm_dir(shm_root)
    ck = Checkpointer(shm, ckpt, 0, 1)
    try:
        got = ck.load_latest()
        reports = [json.loads(p.read_text()) for p in sorted((shm / "reports").glob("*.json"))]
        return got, [r for r in reports if r["kind"] == "checkpoint_fallback"]
    finally:
        ck.close()
        release_shm_dir(shm)


def seal(body: bytes) -> bytes:
    """What a crafted file would carry: a correct checksum line for whatever body it has."""
    return body + SEAL + b"%08x\n" % zlib.crc32(body)


def edit(path: Path, change) -> None:
    """Edit the JSON as a person with an editor would: the checksum line stays as it was."""
    body, sep, tail = path.read_bytes().rpartition(SEAL)
    if not sep:  # a manifest without a checksum line (as trainguard-ckpt/1 wrote them)
        body, tail = tail, b""
    meta = json.loads(body)
    change(meta)
    path.write_bytes(json.dumps(meta, separators=(",", ":")).encode() + sep + tail)


def lr(m):
    m["tree"]["D"][1][1]["D"][0][1] = 10.0  # optim.lr


def step(m):
    m["step"] = 3


def shape(m):
    m["tensors"][0]["shape"] = [3, 4]


def dtype(m):
    m["tensors"][0]["dtype"] = "int32"


@pytest.mark.parametrize("change", [lr, step, shape, dtype])
def test_checkpoint_edited_manifest_is_refused_and_the_previous_step_loaded(tmp_path, shm_root, change):
    """The whole manifest is under the checksum, not only the tensor bytes."""
    ckpt = two_steps(tmp_path, shm_root)
    got, _ = load(ckpt, shm_root)
    assert got["step"] == 2 and got["optim"]["lr"] == pytest.approx(0.2)
    edit(disk.step_dir(ckpt, 2) / disk.manifest_name(0), change)
    got, fallbacks = load(ckpt, shm_root)
    assert got["step"] == 1 and torch.equal(got["w"], torch.full((4, 3), 1.0))
    [fb] = fallbacks
    assert "manifest checksum" in fb["evidence"]["corrupt"][0]["error"]


def test_checkpoint_older_format_without_manifest_checksum_is_refused_clearly(tmp_path, shm_root):
    ckpt = two_steps(tmp_path, shm_root)
    path = disk.step_dir(ckpt, 2) / disk.manifest_name(0)
    body = path.read_bytes().rpartition(SEAL)[0]
    meta = json.loads(body)
    meta["format"] = "trainguard-ckpt/1"
    path.write_text(json.dumps(meta))  # as version 1 wrote it: plain JSON, no checksum line
    got, [fb] = load(ckpt, shm_root)
    assert got["step"] == 1
    assert "older trainguard" in fb["evidence"]["corrupt"][0]["error"]


# --- crafted files -------------------------------------------------------------------------------------
def crafted_body(**override) -> dict:
    meta = {"format": FORMAT, "rank": 0, "world_size": 1, "step": 3, "time": 0.0, "sharded": False,
            "tree": {"T": 0}, "tensors": [{"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8, "device": "cpu"}],
            "data": {"file": "rank-00000.bin", "size": 8, "checksum": "crc32", "value": zlib.crc32(bytes(8))}}
    meta.update(override)
    return meta


def deep_tree(sdir: Path) -> None:
    body = json.dumps(crafted_body(tree="@")).encode().replace(b'"@"', b'{"L":[' * 100_000 + b"1" + b"]}" * 100_000)
    (sdir / "rank-00000.json").write_bytes(seal(body))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def deep_json(sdir: Path) -> None:
    (sdir / "rank-00000.json").write_bytes(seal(b"[" * 1_000_000 + b"]" * 1_000_000))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def huge_manifest(sdir: Path) -> None:
    with open(sdir / "rank-00000.json", "wb") as f:
        f.truncate(300 << 20)  # sparse: costs no disk
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def huge_data(sdir: Path) -> None:
    n = 1 << 40  # 1 TiB claimed, and the (sparse) file really is that long
    meta = crafted_body(tensors=[{"dtype": "float32", "shape": [n // 4], "offset": 0, "nbytes": n, "device": "cpu"}],
                        data={"file": "rank-00000.bin", "size": n, "checksum": "crc32", "value": 0})
    (sdir / "rank-00000.json").write_bytes(seal(json.dumps(meta).encode()))
    with open(sdir / "rank-00000.bin", "wb") as f:
        f.truncate(n)


def huge_shape(sdir: Path) -> None:
    meta = crafted_body(tensors=[{"dtype": "float32", "shape": [1 << 70, 0], "offset": 0, "nbytes": 0}])
    (sdir / "rank-00000.json").write_bytes(seal(json.dumps(meta).encode()))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def overflowing_strides(sdir: Path) -> None:
    """Each dim in range, the tensor empty, but its strides overflow int64 (torch raised RuntimeError)."""
    meta = crafted_body(tensors=[{"dtype": "float32", "shape": [0, 1 << 61, 1 << 61], "offset": 0, "nbytes": 0}])
    (sdir / "rank-00000.json").write_bytes(seal(json.dumps(meta).encode()))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def bad_nodes(sdir: Path) -> None:
    meta = crafted_body(tree={"D": 5})
    (sdir / "rank-00000.json").write_bytes(seal(json.dumps(meta).encode()))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


def float_sizes(sdir: Path) -> None:
    meta = crafted_body(tensors=[{"dtype": "float32", "shape": [1e300], "offset": 0.0, "nbytes": 8}])
    (sdir / "rank-00000.json").write_bytes(seal(json.dumps(meta).encode()))
    (sdir / "rank-00000.bin").write_bytes(bytes(8))


@pytest.mark.parametrize("craft", [deep_tree, deep_json, huge_manifest, huge_data, huge_shape, overflowing_strides, bad_nodes, float_sizes])
def test_checkpoint_crafted_newest_file_falls_back_without_a_traceback(tmp_path, shm_root, craft):
    """A crafted (correctly checksummed) or corrupt newest checkpoint is skipped with a
    reason; no MemoryError, RecursionError or other exception escapes load_latest."""
    ckpt = two_steps(tmp_path, shm_root)
    sdir = disk.step_dir(ckpt, 3)
    sdir.mkdir()
    craft(sdir)
    got, [fb] = load(ckpt, shm_root)
    assert got["step"] == 2
    [bad] = fb["evidence"]["corrupt"]
    assert bad["step"] == 3 and bad["error"]
