"""Per-layer attention statistics kept on the device (read them only when logging: no host sync here)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

COUNTERS = ("repeated_max_rows", "rows_seen", "underflow_rows", "sfa_p1_rows", "fp16_overflow", "fp8_saturated",
            "pbar_flushed")  # (H,) int64 each
FORMAT_COUNTERS = ("fp16_overflow", "fp8_saturated", "pbar_flushed")  # what a cast did (kernels/formats.py)


class AttnStats:
    """Counters one attention layer accumulates across calls until `reset()`.

    repeated_max_rows: (H,) int64, number of (query row, key tile) pairs whose tile row max is attained more than once
        within eps (masked entries excluded): the condition under which the stabilized softmax (Algorithm 3) fires.
        With tiling off, one tile spans the row, so this is the number of rows with repeated maxima.
    rows_seen: (H,) int64, number of (query row, key tile) pairs examined, the denominator of a rate.
    underflow_rows: (H,) int64, query rows whose row sum l (before paper_bf16's floor) ended below the floor (1e-10
        for paper_bf16, the smallest normal number otherwise) or NaN: every P̄ of the row underflowed, as the exact
        Algorithm 3 does for large repeated maxima. Such a row returns NaN (fa2, fp32) or zeros (paper_bf16).
        Counted by the emulator and by the Triton forward (with counters on), as is sfa_p1_rows.
    sfa_p1_rows: (H,) int64, (query row, key tile) pairs where the stabilized shift fired (or, guarded, should have)
        but some P̄ fed to the P̄V GEMM still rounded to 1 (e.g. beta = 1.0001 in BF16): the shift did nothing there.
    fp16_overflow: (H,) int64, finite values an FP16 store (inputs, scores, P̄, O, ...) turned into inf, forward and
        backward (kernels/formats.py: |x| >= 65520).
    fp8_saturated: (H,) int64, values an FP8 store clipped at the format's max (|x * scale| >= 464 for e4m3,
        61440 for e5m2), forward and backward.
    pbar_flushed: (H,) int64, P̄ entries > 0 that the P̄V store rounded to 0 (below the format's smallest
        subnormal after its scale: e4m3 unscaled flushes P̄ < 2^-10).
    max_logit: () float32, running max of the scaled scores S = QK^T / sqrt(D) (masked entries excluded).
    """

    def __init__(self, n_head: int, device=None):
        if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0:
            raise ValueError(f"n_head={n_head!r} is not allowed: expected an integer > 0")
        self.n_head = n_head
        for name in COUNTERS:
            setattr(self, name, torch.zeros(n_head, dtype=torch.int64, device=device))
        self.max_logit = torch.full((), float("-inf"), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.repeated_max_rows.device

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """Every counter, then max_logit: the device tensors the kernels add into."""
        return tuple(getattr(self, n) for n in COUNTERS) + (self.max_logit,)

    def reset(self) -> None:
        for name in COUNTERS:
            getattr(self, name).zero_()
        self.max_logit.fill_(float("-inf"))

    def snapshot(self) -> Tuple[torch.Tensor, ...]:
        """Device copies of every counter (e.g. around an evaluation that must not count)."""
        return tuple(t.clone() for t in self.tensors())

    def restore(self, snap: Tuple[torch.Tensor, ...]) -> None:
        for name, t in zip(COUNTERS + ("max_logit",), snap):
            getattr(self, name).copy_(t)

    def update(self, repeated: torch.Tensor, tile_max: torch.Tensor, sfa_p1: Optional[torch.Tensor] = None,
               seen: Optional[torch.Tensor] = None) -> None:
        """Fold one tile in: `repeated` (B, H, rows, 1) bool, `tile_max` any-shape scores' max, `sfa_p1` (B, H, rows,
        1) bool rows where the shift fired but P̄ = 1 survived, `seen` (B, H, rows, 1) bool the rows with a key in
        the tile (masks other than causal; None: every row). In place, no sync."""
        self.repeated_max_rows.add_(repeated.sum(dim=(0, 2, 3)))
        if seen is None:
            self.rows_seen.add_(repeated.shape[0] * repeated.shape[2])
        else:
            self.rows_seen.add_(seen.sum(dim=(0, 2, 3)))
        torch.maximum(self.max_logit, tile_max.max().to(torch.float32), out=self.max_logit)
        if sfa_p1 is not None:
            self.sfa_p1_rows.add_(sfa_p1.sum(dim=(0, 2, 3)))

    def update_format(self, name: str, mask: torch.Tensor) -> None:
        """Add a (B, H, ...) bool mask of one store into the format counter `name` (FORMAT_COUNTERS), per head."""
        getattr(self, name).add_(mask.transpose(0, 1).reshape(mask.shape[1], -1).sum(-1))

    def update_underflow(self, under: torch.Tensor) -> None:
        """`under` (B, H, rows, 1) bool: rows of one query tile whose final row sum is under the floor."""
        self.underflow_rows.add_(under.sum(dim=(0, 2, 3)))

    def __repr__(self) -> str:  # shows device tensors without forcing a sync on creation
        return f"AttnStats(n_head={self.n_head}, device={self.device})"
