"""GPT-2 BPE through tiktoken, with an offline route.

tiktoken's "gpt2" encoding downloads vocab.bpe/encoder.json at first use. The r50k_base ranks are the same
vocabulary (same merges, regex and <|endoftext|> = 50256) in one file, and the openai-whisper sdist on PyPI ships
that file as whisper/assets/gpt2.tiktoken. We put it where tiktoken's cache looks (TIKTOKEN_CACHE_DIR, file named
sha1(url)) and let tiktoken load it, so tiktoken's own sha256 check still guards it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

from flash_forensics.orchestrator.data.cache import (
    FetchError,
    atomic_write,
    cache_dir,
    member_from_archive,
    member_from_sdist,
)

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"  # pinned: any release ships the same file; the hash decides
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"
EOT = 50256
N_VOCAB = 50257


class TokenizerUnavailable(RuntimeError):
    pass


def tiktoken_cache_dir() -> Path:
    env = os.environ.get("TIKTOKEN_CACHE_DIR")
    return Path(env) if env else cache_dir() / "tiktoken"


def ranks_path() -> Path:
    return tiktoken_cache_dir() / hashlib.sha1(R50K_URL.encode()).hexdigest()


def _has_valid_ranks(path: Path) -> bool:
    if not path.is_file():
        return False
    return hashlib.sha256(path.read_bytes()).hexdigest() == R50K_SHA256


def install_ranks(source: Optional[Path] = None) -> Path:
    """Put the verified GPT-2 ranks into tiktoken's cache. source: a gpt2.tiktoken / r50k_base.tiktoken file or an
    openai-whisper sdist (.tar.gz); None fetches the sdist with pip. Returns the cache file."""
    dest = ranks_path()
    if source is not None:
        source = Path(source)
        if source.name.endswith((".tar.gz", ".tgz")):
            data = member_from_archive(source, WHISPER_MEMBER, R50K_SHA256)
        else:
            data = source.read_bytes()
            got = hashlib.sha256(data).hexdigest()
            if got != R50K_SHA256:
                raise TokenizerUnavailable(f"{source} has sha256 {got}, but the GPT-2 (r50k_base) ranks have "
                                           f"{R50K_SHA256}; not installed")
    else:
        data = member_from_sdist(WHISPER_SDIST, WHISPER_MEMBER, R50K_SHA256)
    atomic_write(dest, data)
    return dest


def _instructions(why: str) -> str:
    return (
        f"GPT-2 tokenizer unavailable: {why}\n"
        f"tiktoken needs the GPT-2 BPE ranks (sha256 {R50K_SHA256}) at {ranks_path()}.\n"
        "Fix, on any machine that can reach PyPI:\n"
        "  flash-forensics data tokenizer            # fetches the openai-whisper sdist, verifies, caches\n"
        f"then copy {cache_dir()} to this machine (or set FLASH_FORENSICS_CACHE / TIKTOKEN_CACHE_DIR to a copy).\n"
        "Or, with the file at hand: flash-forensics data tokenizer --from PATH\n"
        f"  (PATH = gpt2.tiktoken from the openai-whisper sdist ({WHISPER_MEMBER}), or the sdist itself)."
    )


@functools.lru_cache(maxsize=1)
def gpt2_encoding(fetch: bool = True):
    """tiktoken Encoding for GPT-2: cache first, then the whisper sdist via pip, then tiktoken's URL."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = ranks_path()
    errors = []
    if not _has_valid_ranks(path):  # tiktoken's own default cache may already hold it (hash checked on copy)
        stray = Path(tempfile.gettempdir()) / "data-gym-cache" / path.name
        if _has_valid_ranks(stray):
            atomic_write(path, stray.read_bytes())
    if not _has_valid_ranks(path) and fetch:
        try:
            install_ranks()
        except (FetchError, OSError) as e:
            errors.append(str(e))
    if not _has_valid_ranks(path) and fetch:
        try:  # tiktoken's own download into the same cache file (hash-checked by tiktoken)
            _load(load_tiktoken_bpe)
        except Exception as e:  # requests/urllib errors vary; all mean "no network"
            errors.append(f"download from tiktoken's URL failed: {type(e).__name__}")
    if not _has_valid_ranks(path):
        raise TokenizerUnavailable(_instructions("; ".join(errors) or "not in the cache and fetching is off"))
    ranks = _load(load_tiktoken_bpe)
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=N_VOCAB)


def _load(load_tiktoken_bpe):
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(tiktoken_cache_dir())
    try:
        return load_tiktoken_bpe(R50K_URL, expected_hash=R50K_SHA256)
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def tokenizer_info() -> dict:
    return {"name": "gpt2", "via": "tiktoken", "ranks_sha256": R50K_SHA256, "n_vocab": N_VOCAB, "eot": EOT}
