"""Per-layer attention statistics kept on the device (read them only when logging: no host sync here)."""
from __future__ import annotations

import torch


class AttnStats:
    """Counters one attention layer accumulates across calls until `reset()`.

    repeated_max_rows: (H,) int64, number of (query row, key tile) pairs whose tile row max is attained more than once
        within eps (masked entries excluded): the condition under which the stabilized softmax (Algorithm 3) fires.
        With tiling off, one tile spans the row, so this is the number of rows with repeated maxima.
    rows_seen: (H,) int64, number of (query row, key tile) pairs examined, the denominator of a rate.
    max_logit: () float32, running max of the scaled scores S = QK^T / sqrt(D) (masked entries excluded).
    """

    def __init__(self, n_head: int, device=None):
        if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0:
            raise ValueError(f"n_head={n_head!r} is not allowed: expected an integer > 0")
        self.n_head = n_head
        self.repeated_max_rows = torch.zeros(n_head, dtype=torch.int64, device=device)
        self.rows_seen = torch.zeros(n_head, dtype=torch.int64, device=device)
        self.max_logit = torch.full((), float("-inf"), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.repeated_max_rows.device

    def reset(self) -> None:
        self.repeated_max_rows.zero_()
        self.rows_seen.zero_()
        self.max_logit.fill_(float("-inf"))

    def update(self, repeated: torch.Tensor, tile_max: torch.Tensor) -> None:
        """Fold one tile in: `repeated` (B, H, rows, 1) bool, `tile_max` any-shape scores' max. In place, no sync."""
        self.repeated_max_rows.add_(repeated.sum(dim=(0, 2, 3)))
        self.rows_seen.add_(repeated.shape[0] * repeated.shape[2])
        torch.maximum(self.max_logit, tile_max.max().to(torch.float32), out=self.max_logit)

    def __repr__(self) -> str:  # shows device tensors without forcing a sync on creation
        return f"AttnStats(n_head={self.n_head}, device={self.device})"
