"""Data layer: corpora -> GPT-2 token bins (train.bin/val.bin + manifest) -> recorded/replayable batch order."""
from orchestrator.data.config import CORPORA, DataConfig, DataError
from orchestrator.data.prepare import ensure_prepared
from orchestrator.data.batches import BatchStream, val_batches
from orchestrator.data.replay import order_paths

__all__ = ["CORPORA", "DataConfig", "DataError", "ensure_prepared", "BatchStream", "val_batches", "order_paths"]
