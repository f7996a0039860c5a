"""DataConfig: which corpus, where its token bins live, and how batches are ordered (conf/data/*.yaml)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional

CORPORA = ("default", "text_files", "openwebtext", "debian_docs")
PAST_END = ("regenerate", "refuse")  # data.replay_past_end: what a replay does at steps past the recorded end
REPO_ROOT = Path(__file__).resolve().parents[2]


class DataError(ValueError):
    """A data problem the user can fix; the message says what and how."""


def _bad(key: str, value, allowed: str) -> DataError:
    return DataError(f"{key}={value!r} is not allowed: expected {allowed}")


@dataclass
class DataConfig:
    """The data knobs. Plain types so Hydra types and merges them (structured config)."""

    corpus: str = "default"  # default (offline KJV) | text_files | openwebtext | debian_docs (Debian packages)
    root: str = "data"  # prepared corpora live in <root>/<corpus>-<fingerprint>/; relative = repo root
    files: List[str] = field(default_factory=list)  # text_files: .txt/.jsonl/.parquet paths or globs
    text_key: str = "text"  # .jsonl / .parquet field holding a document
    val_fraction: float = 0.05  # share of documents held out for val.bin
    seed: int = 1337  # batch-order seed: batch (step, micro, rank) is a pure function of it
    replay: Optional[str] = None  # a recorded batch-order file to replay instead of the seeded generator
    # past the replayed file's last step (a fork running longer than its source): regenerate the file's seeded order,
    # once it is checked to reproduce every recorded step, or refuse (orchestrator/data/replay.py)
    replay_past_end: str = "regenerate"
    num_proc: int = 0  # tokenizer threads when preparing; 0 = all cores
    hf_dataset: str = "Skylion007/openwebtext"  # openwebtext: the Hugging Face dataset name
    max_docs: Optional[int] = None  # cap on documents read (quick looks at big corpora); None = all

    def validate(self, key: str = "data") -> "DataConfig":
        """Raise DataError naming key, value and what is allowed; return self."""
        if self.corpus not in CORPORA:
            raise _bad(f"{key}.corpus", self.corpus, "one of " + ", ".join(CORPORA))
        if self.corpus == "text_files" and not list(self.files):
            raise _bad(f"{key}.files", list(self.files),
                       "at least one .txt/.jsonl/.parquet path or glob when corpus=text_files")
        if not isinstance(self.root, str) or not self.root:
            raise _bad(f"{key}.root", self.root, "a non-empty folder path")
        if isinstance(self.val_fraction, bool) or not 0.0 < float(self.val_fraction) < 1.0:
            raise _bad(f"{key}.val_fraction", self.val_fraction, "a number in (0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise _bad(f"{key}.seed", self.seed, "an integer in [0, 2**63)")
        if isinstance(self.num_proc, bool) or not isinstance(self.num_proc, int) or self.num_proc < 0:
            raise _bad(f"{key}.num_proc", self.num_proc, "an integer >= 0 (0 = all cores)")
        if self.max_docs is not None and (isinstance(self.max_docs, bool) or not isinstance(self.max_docs, int)
                                          or self.max_docs <= 0):
            raise _bad(f"{key}.max_docs", self.max_docs, "null or an integer > 0")
        if self.replay_past_end not in PAST_END:
            raise _bad(f"{key}.replay_past_end", self.replay_past_end, "one of " + ", ".join(PAST_END))
        if self.replay is not None and not str(self.replay):
            raise _bad(f"{key}.replay", self.replay, "null or the path of a recorded batch-order file")
        return self

    @property
    def root_path(self) -> Path:
        p = Path(os.path.expanduser(self.root))
        return p if p.is_absolute() else REPO_ROOT / p

    @property
    def threads(self) -> int:
        return self.num_proc or (os.cpu_count() or 1)

    @classmethod
    def from_any(cls, cfg) -> "DataConfig":
        """Accept a DataConfig, a DictConfig (Hydra) or a dict."""
        if isinstance(cfg, cls):
            return cfg
        from omegaconf import OmegaConf

        node = OmegaConf.merge(OmegaConf.structured(cls), cfg)
        return OmegaConf.to_object(node)


@dataclass
class Corpus:
    name: str
    source: dict  # goes into manifest.json
    fingerprint: str  # sha256 hex of everything that determines the tokens
    documents: Callable[[], Iterator[str]]
    n_docs: Optional[int] = None  # for the progress bar, when known
