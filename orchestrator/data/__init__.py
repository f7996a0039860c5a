"""Data layer: corpora -> GPT-2 token bins (train.bin/val.bin + manifest) -> recorded/replayable batch order."""
from flash_forensics.orchestrator.data.batches import BatchStream, val_batches
from flash_forensics.orchestrator.data.config import CORPORA, DataConfig, DataError
from flash_forensics.orchestrator.data.prepare import ensure_prepared
from flash_forensics.orchestrator.data.replay import order_paths

__all__ = ["CORPORA", "DataConfig", "DataError", "ensure_prepared", "BatchStream", "val_batches", "order_paths"]
