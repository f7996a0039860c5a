"""Corpus -> <root>/<corpus>-<fingerprint>/{train.bin, val.bin, manifest.json} (uint16 GPT-2 ids, nanoGPT's format).

Written into a temp folder and renamed into place, under a file lock: a crash leaves no half-written folder and
concurrent callers (SLURM array jobs) prepare once. Documents end with <|endoftext|>; each goes to val with
probability val_fraction (seeded, so streaming corpora split the same way every time).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, List

import numpy as np
from tqdm import tqdm

from flash_forensics.orchestrator.data.cache import sha256_file
from flash_forensics.orchestrator.data.config import DataConfig, DataError
from flash_forensics.orchestrator.data.corpora import Corpus, check_text, open_corpus
from flash_forensics.orchestrator.data.tokenizer import EOT, gpt2_encoding, tokenizer_info
from flash_forensics.orchestrator.lockfile import exclusive

FORMAT = "flash-forensics-tokens"
FORMAT_VERSION = 1
SPLIT_SEED = 2357  # nanoGPT's split seed
DOCS_PER_CHUNK = 512
HASH_CHECK_MAX_BYTES = 1 << 30  # bins above this are checked by size only (hashing 17 GiB per job is too slow)


def dataset_dir(cfg: DataConfig, corpus: Corpus) -> Path:
    split = {"val_fraction": float(cfg.val_fraction), "max_docs": cfg.max_docs, "split_seed": SPLIT_SEED,
             "format_version": FORMAT_VERSION}
    key = hashlib.sha256((corpus.fingerprint + json.dumps(split, sort_keys=True)).encode()).hexdigest()[:12]
    return cfg.root_path / f"{corpus.name}-{key}"


def _file_lock(path: Path):
    """An exclusive lock on `path`, removed by its holder (no .lock left beside the corpus, prepared or refused)."""
    return exclusive(path)


def _chunks(docs: Iterator[str], n: int, limit) -> Iterator[List[str]]:
    chunk: List[str] = []
    for i, d in enumerate(docs):
        if limit is not None and i >= limit:
            break
        chunk.append(d)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _BinWriter:
    def __init__(self, path: Path):
        self.path, self.f, self.n, self.max_id = path, open(path, "wb"), 0, -1

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            self.f.write(ids.astype(np.uint16).tobytes())
            self.n += int(ids.size)
            self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def tokenize_into(corpus: Corpus, cfg: DataConfig, out: Path) -> dict:
    """Tokenize corpus into out/train.bin and out/val.bin; return the manifest (also written)."""
    enc = gpt2_encoding()
    rng = np.random.default_rng(SPLIT_SEED)
    train, val = _BinWriter(out / "train.bin"), _BinWriter(out / "val.bin")
    n_docs = {"train": 0, "val": 0}
    t0 = time.perf_counter()
    total = corpus.n_docs if cfg.max_docs is None else min(corpus.n_docs or cfg.max_docs, cfg.max_docs)
    try:
        with tqdm(total=total, unit="doc", desc=f"tokenizing {corpus.name}", dynamic_ncols=True) as bar:
            for chunk in _chunks(corpus.documents(), DOCS_PER_CHUNK, cfg.max_docs):
                ids = enc.encode_ordinary_batch(chunk, num_threads=cfg.threads)
                to_val = rng.random(len(ids)) < cfg.val_fraction
                for part, writer in ((False, train), (True, val)):
                    docs = [np.array(d + [EOT], dtype=np.int64) for d, v in zip(ids, to_val) if v == part]
                    if docs:
                        writer.write(np.concatenate(docs))
                    n_docs["val" if part else "train"] += len(docs)
                bar.update(len(chunk))
                bar.set_postfix(tokens=train.n + val.n, refresh=False)
    finally:
        train.close()
        val.close()
    seconds = time.perf_counter() - t0
    if train.n + val.n == 0:
        raise DataError(f"corpus {corpus.name!r} has no text (no non-empty document); nothing prepared")
    split = "documents"
    if val.n == 0 or train.n == 0:  # too few documents for a document split: hold out the tail tokens instead
        split = "tail"
        _tail_split(out, val_fraction=cfg.val_fraction)
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "dtype": "uint16", "corpus": corpus.name,
        "source": corpus.source, "source_fingerprint": corpus.fingerprint, "tokenizer": tokenizer_info(),
        "split": {"method": split, "val_fraction": cfg.val_fraction, "seed": SPLIT_SEED, "docs": n_docs,
                  "max_docs": cfg.max_docs},
        "files": {}, "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prepare_seconds": round(seconds, 3), "tokens_per_s": round((train.n + val.n) / max(seconds, 1e-9)),
        "threads": cfg.threads,
    }
    max_id = -1
    for name in ("train", "val"):
        p = out / f"{name}.bin"
        arr = np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
        m = int(arr.max()) if arr.size else -1
        max_id = max(max_id, m)
        manifest["files"][p.name] = {"tokens": int(arr.size), "bytes": p.stat().st_size, "sha256": sha256_file(p),
                                     "max_id": m}
        del arr
    manifest["tokens"] = {k: manifest["files"][f"{k}.bin"]["tokens"] for k in ("train", "val")}
    manifest["max_id"] = max_id
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _tail_split(out: Path, val_fraction: float) -> None:
    """All tokens into train.bin, then its last ceil(val_fraction * n) tokens (at least 1) move to val.bin."""
    tr, va = out / "train.bin", out / "val.bin"
    allt = np.concatenate([np.fromfile(tr, np.uint16), np.fromfile(va, np.uint16)])
    n_val = max(1, int(np.ceil(val_fraction * allt.size)))
    if allt.size - n_val < 1:
        raise DataError(f"corpus has {allt.size} tokens: too few to split into train and val")
    allt[:-n_val].tofile(tr)
    allt[-n_val:].tofile(va)


def prepare(cfg: DataConfig, force: bool = False) -> Path:
    """Prepare cfg's corpus (if not already there, or always with force); return its folder."""
    cfg = DataConfig.from_any(cfg).validate()
    check_text(cfg)  # a binary or empty file: refused before the lock and the tokenizer
    corpus = open_corpus(cfg)
    final = dataset_dir(cfg, corpus)
    with _file_lock(final.with_name(f".{final.name}.lock")):
        if final.is_dir() and not force:
            return final
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            tokenize_into(corpus, cfg, tmp)
            if final.is_dir():  # force: swap out the old folder only once the new one is complete
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_prepared(folder: Path, vocab_size: int, hash_check_max_bytes: int = HASH_CHECK_MAX_BYTES) -> dict:
    """Validate a prepared folder against its manifest; return the manifest. Raises DataError saying what is wrong."""
    mpath = folder / "manifest.json"
    hint = f"delete {folder} and prepare again (`flash-forensics data prepare ... --force`)"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{mpath} is missing or not JSON ({e}); {hint}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{mpath} is not a {FORMAT} v{FORMAT_VERSION} manifest; {hint}")
    if manifest["tokenizer"].get("ranks_sha256") != tokenizer_info()["ranks_sha256"]:
        raise DataError(f"{folder} was tokenized with another BPE ({manifest['tokenizer']}); {hint}")
    for name, meta in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise DataError(f"{p} is missing; {hint}")
        size = p.stat().st_size
        if size % 2:
            raise DataError(f"{p} has an odd byte count ({size}): not whole uint16 tokens; {hint}")
        if size != meta["bytes"] or size != 2 * meta["tokens"]:
            raise DataError(f"{p} has {size} bytes but the manifest says {meta['bytes']} ({meta['tokens']} tokens); "
                            f"{hint}")
        if size <= hash_check_max_bytes and sha256_file(p) != meta["sha256"]:
            raise DataError(f"{p} does not match the sha256 in its manifest (changed after preparing); {hint}")
    max_id = int(manifest["max_id"])
    if max_id >= vocab_size:
        raise DataError(f"{folder}: token id {max_id} occurs but the model's vocab_size is {vocab_size}; "
                        f"GPT-2 ids need model.vocab_size >= {max_id + 1} (50304 is the usual padded size)")
    return manifest


def ensure_prepared(cfg, vocab_size: int, force: bool = False) -> Path:
    """The prepared folder for cfg (DataConfig / DictConfig / dict): prepared if missing, then validated."""
    folder = prepare(cfg, force=force)
    check_prepared(folder, vocab_size)
    return folder
