"""The attention snapshot file: round trip, the size said before writing and the cap, atomic writes, and every kind
of bad file refused with one message naming what is wrong (and exit 2 from the CLI, no traceback)."""
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from flash_forensics.capture import snapshot as S
from flash_forensics.capture.cli import main
from flash_forensics.capture.recorder import write_call
from flash_forensics.capture.synthetic import random_inputs
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import reference_attention


@pytest.fixture
def capture_file(tmp_path):
    q, k, v, do = random_inputs(2, 2, 32, 16, seed=1)
    kn = AttentionKnobs(recipe="fa2")
    o, lse, *_ = reference_attention(q, k, v, kn)
    path = write_call(tmp_path / "c.safetensors", q, k, v, o, do, lse, recipe="fa2", knobs=kn.knob_values(),
                      family="test", layer=0)
    return path, dict(q=q, k=k, v=v, o=o, do=do, lse=lse)


def _rewrite(path, tensors, header_md):
    """Write a safetensors file with these tensors and metadata (bypassing the checks of S.write)."""
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=header_md)


def _ours(tensors, meta):
    meta_json = json.dumps({**meta, "tensors": sorted(tensors)}, sort_keys=True)
    return {"format": S.FORMAT, "format_version": str(S.FORMAT_VERSION), "meta": meta_json,
            "content_sha256": S.content_hash(tensors, meta_json)}


def test_round_trip_keeps_tensors_bits_and_provenance(capture_file):
    path, t = capture_file
    snap = S.read(path)
    for name in ("q", "k", "v", "o", "do", "lse"):
        assert snap.tensors[name].dtype == t[name].dtype if name != "lse" else torch.float32
        assert torch.equal(snap.tensors[name].float(), t[name].float())
    m = snap.meta
    assert m["recipe"] == "fa2" and m["knobs"]["recipe"] == "fa2" and m["layer"] == 0 and m["heads"] == [0, 1]
    assert m["versions"]["torch"] == torch.__version__ and "safetensors" in m["versions"]
    assert m["dtypes"]["q"] == "bfloat16" and m["dtypes"]["do"] == "bfloat16" and m["device"] == "cpu"
    assert "git_commit" in m and m["has_do"] is True


def test_size_is_said_before_writing_and_the_cap_refuses(tmp_path):
    q, k, v, do = random_inputs(2, 2, 64, 16)
    said = []
    write_call(tmp_path / "a.safetensors", q, k, v, q, do, say=said.append)
    assert len(said) == 1 and "MiB" in said[0] and "cap 64 MiB" in said[0]
    with pytest.raises(S.SnapshotError, match=r"over the cap of 1000 bytes"):
        write_call(tmp_path / "b.safetensors", q, k, v, q, do, max_bytes=1000, say=said.append)
    assert not (tmp_path / "b.safetensors").exists() and len(said) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no temp file left


def test_a_failed_rename_leaves_the_old_file_and_no_temp(capture_file, monkeypatch):
    path, t = capture_file
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk gone")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_call(path, t["q"], t["k"], t["v"], t["o"], t["do"])
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def _cases(tmp_path, path, t):
    """name -> (file, the words its message must hold)."""
    raw = path.read_bytes()
    out = {}
    p = tmp_path / "truncated.safetensors"
    p.write_bytes(raw[: len(raw) - 100])
    out["truncated"] = (p, "truncated")
    p = tmp_path / "short.safetensors"
    p.write_bytes(raw[:5])
    out["short"] = (p, "not a safetensors file")
    p = tmp_path / "text.safetensors"
    p.write_text("hello, I am a CSV file\n1,2,3\n")
    out["not_safetensors"] = (p, "not a safetensors file")
    p = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(p), metadata={"format": "pt"})
    out["foreign"] = (p, "foreign file")
    p = tmp_path / "tampered.safetensors"
    b = bytearray(raw)
    b[-3] ^= 0x40  # one bit of the last tensor's data
    p.write_bytes(bytes(b))
    out["tampered"] = (p, "tampered")
    snap = S.read(path)
    tens = dict(snap.tensors)
    tens.pop("o")
    p = tmp_path / "missing.safetensors"
    _rewrite(p, tens, _ours(tens, {k: v for k, v in snap.meta.items() if k != "tensors"}))
    out["missing"] = (p, "missing tensor o")
    tens = dict(snap.tensors)
    tens["v"] = tens["v"][:, :, :-1].contiguous()
    p = tmp_path / "shapes.safetensors"
    _rewrite(p, tens, _ours(tens, snap.meta))
    out["shapes"] = (p, "mismatched shapes: v")
    p = tmp_path / "version.safetensors"
    md = _ours(snap.tensors, snap.meta)
    md["format_version"] = "99"
    _rewrite(p, snap.tensors, md)
    out["version"] = (p, "unknown format version '99'")
    out["absent"] = (tmp_path / "nope.safetensors", "no such file")
    return out


def test_bad_files_are_refused_each_with_one_message(tmp_path, capture_file, capsys):
    path, t = capture_file
    for name, (p, words) in _cases(tmp_path, path, t).items():
        with pytest.raises(S.SnapshotError) as e:
            S.read(p)
        assert words in str(e.value) and str(p) in str(e.value), (name, str(e.value))
        assert main([str(p), "--quiet"]) == 2, name
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)


def test_header_length_past_the_end_is_truncation_not_garbage(tmp_path, capture_file):
    path, _ = capture_file
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    p = tmp_path / "cut_header.safetensors"
    p.write_bytes(raw[: 8 + n // 2])
    with pytest.raises(S.SnapshotError, match="truncated"):
        S.read(p)
