"""flash-forensics data prepare [overrides] [--force] | fetch | tokenizer [--from PATH]

Overrides are Hydra's, composed from conf/data like the runs are: `data=text_files 'data.files=[a.txt]'`,
`data.root=/scratch/data`; a bare DataConfig field (`val_fraction=0.1`) means data.<field>.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, List

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config (the root config compose_data may need)
from flash_forensics.orchestrator.data.config import REPO_ROOT, DataConfig, DataError
from flash_forensics.orchestrator.data.corpora import kjv_path
from flash_forensics.orchestrator.data.prepare import ensure_prepared
from flash_forensics.orchestrator.data.tokenizer import (
    N_VOCAB,
    TokenizerUnavailable,
    gpt2_encoding,
    install_ranks,
    ranks_path,
)


@dataclass
class PrepareRoot:
    defaults: List[Any] = field(default_factory=lambda: ["_self_", {"data": "default"}])
    data: DataConfig = field(default_factory=DataConfig)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_data(overrides: List[str]) -> DataConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    names = {f.name for f in fields(DataConfig)}
    overrides = [f"data.{o}" if _key(o) in names else o for o in overrides]
    # data-only overrides compose conf/data alone; others (experiment=gpt2s_paper) need the project's root config
    root_name = "ff_data_prepare"
    if any(_key(o) != "data" and not _key(o).startswith("data.") for o in overrides):

        root_name = "config"
    ConfigStore.instance().store(name="ff_data_prepare", node=PrepareRoot)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base=None, config_dir=str(REPO_ROOT / "conf")):
            cfg = compose(config_name=root_name, overrides=overrides)
    except Exception as e:  # Hydra's messages name the group/key and the options; keep them, drop the trace
        raise DataError(f"config: {e}") from e
    return OmegaConf.to_object(cfg.data).validate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into train.bin/val.bin + manifest.json")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--force", action="store_true", help="prepare again even if the folder exists")
    p.add_argument("--vocab-size", type=int, default=50304, help="model vocab size the ids must fit (50304)")
    sub.add_parser("fetch", help="fill the user cache (GPT-2 BPE + default corpus) for offline use")
    t = sub.add_parser("tokenizer", help="install the GPT-2 BPE ranks into the cache")
    t.add_argument("--from", dest="source", help="gpt2.tiktoken file or openai-whisper sdist (.tar.gz)")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command: "required: {a,b}", not "required: cmd"
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "prepare":  # overrides after an option (`--force data=text_files`) were 'unrecognized arguments'
        args.overrides += [a for a in extra if "=" in a and not a.startswith("-")]
        extra = [a for a in extra if a not in args.overrides]
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "prepare" and args.vocab_size < N_VOCAB:  # else refused only after the whole corpus is tokenized
        p.error(f"--vocab-size={args.vocab_size} is not allowed: expected an integer >= {N_VOCAB} (the GPT-2 "
                "tokenizer's ids; 50304 is the usual padded size)")
    try:
        if args.cmd == "prepare":

            cfg = compose_data(args.overrides)
            folder = ensure_prepared(cfg, args.vocab_size, force=args.force)
            m = json.loads((folder / "manifest.json").read_text())
            print(f"{folder}\n  tokens: train {m['tokens']['train']:,}  val {m['tokens']['val']:,}  max id "
                  f"{m['max_id']}\n  prepared in {m['prepare_seconds']} s ({m['tokens_per_s']:,} tokens/s, "
                  f"{m['threads']} threads)")
        elif args.cmd == "fetch":

            gpt2_encoding()
            print(f"GPT-2 BPE ranks: {ranks_path()}\ndefault corpus:  {kjv_path()}")
        else:

            if args.source:
                if not os.path.isfile(args.source):
                    raise DataError(f"--from={args.source!r}: no such file (expected gpt2.tiktoken or the "
                                    "openai-whisper sdist .tar.gz)")
                install_ranks(args.source)
            gpt2_encoding()
            print(f"GPT-2 BPE ranks verified at {ranks_path()}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:

        if isinstance(e, TokenizerUnavailable):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, (FileExistsError, NotADirectoryError, PermissionError)):  # data.root a file, unwritable
            print(f"error: {e.filename or ''}: {e.strerror} (data.root / the data folder must be a writable "
                  "folder)", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
