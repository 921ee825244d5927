"""Sequence-length warm-up (`data.seq_len_warmup`): the first part of a long-context run trains on shorter
sequences, the same tokens per step.

    data:
      seq_len: 32768
      seq_len_warmup: [{until: 0.02, seq_len: 2048}, {until: 0.05, seq_len: 8192}]

While the fraction of the steps done is below a stage's `until`, each micro-batch's rows of data.seq_len tokens are
cut into rows of the stage's `seq_len` (which divides data.seq_len): (B, T) -> (B T / L, L), every token keeping its
target (the row's last token's target is the next row's first token, as in the reader's windows). With packed
documents (data.cu_seqlens) the cuts are added to the document offsets, so no document is longer than L. The reader,
its data position, the step's tokens and the schedule are those of the run at full length; short sequences at the
start are cheaper per token (attention) and steadier (long-range gradients come once the model has local
statistics), as in the sequence-length warm-up of Li et al. (2022, "The stability-efficiency dilemma") and the
staged context of long-context recipes. Evaluation runs at data.seq_len throughout.
"""
from __future__ import annotations

import torch

from .data import MappedReader


def parse_stages(value, seq_len: int, context_parallel: int = 1) -> list[tuple[float, int]]:
    """data.seq_len_warmup -> [(until, seq_len), ...]; a ValueError naming the field and what to change."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"data.seq_len_warmup: expected a list of {{until, seq_len}}, got {value!r}")
    stages, prev_until, prev_len = [], 0.0, 0
    for i, item in enumerate(value):
        where = f"data.seq_len_warmup[{i}]"
        if not isinstance(item, dict) or set(item) != {"until", "seq_len"}:
            raise ValueError(f"{where}: expected {{until: <fraction of the steps>, seq_len: <tokens>}}, got {item!r}")
        until, length = item["until"], item["seq_len"]
        if not isinstance(until, (int, float)) or not prev_until < until < 1:
            raise ValueError(f"{where}.until: must be a fraction in ({prev_until}, 1), increasing (after the last "
                             f"stage the run trains at data.seq_len), got {until!r}")
        if not isinstance(length, int) or length < 1 or seq_len % length or length >= seq_len:
            raise ValueError(f"{where}.seq_len: must be a divisor of data.seq_len {seq_len} below it, got {length!r}")
        if length <= prev_len:
            raise ValueError(f"{where}.seq_len: the stages' lengths must grow, got {length} after {prev_len}")
        if length % context_parallel:
            raise ValueError(f"{where}.seq_len: {length} is not a multiple of train.context_parallel "
                             f"{context_parallel} (each rank holds seq_len / context_parallel tokens of a sequence)")
        stages.append((float(until), length))
        prev_until, prev_len = until, length
    return stages


def cut_rows(batch: dict, length: int) -> dict:
    """A reader batch of rows (B, T) as rows of `length` tokens (B T / length, length); packed documents' offsets
    (over the flattened micro-batch) gain a cut every `length` tokens."""
    ids, targets = batch["input_ids"], batch["targets"]
    if ids.shape[1] == length:
        return batch
    out = {**batch, "input_ids": ids.reshape(-1, length), "targets": targets.reshape(-1, length)}
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"]
        cuts = torch.arange(0, ids.numel() + 1, length, dtype=cu.dtype, device=cu.device)
        out["cu_seqlens"] = torch.unique(torch.cat([cu, cuts]))  # sorted, without repeats
    return out


class LengthWarmup(MappedReader):
    """A training reader whose micro-batches are cut to the current stage's length (see the module docstring);
    `enter(step)` before each step. Its state (resume) is the reader's own: the stage follows from the step."""

    def __init__(self, reader, stages: list[tuple[float, int]], seq_len: int, total_steps: int):
        super().__init__(reader)
        self.stages, self.seq_len, self.total_steps = stages, seq_len, total_steps
        self.length = None  # set by `enter`; data.seq_len until then

    def enter(self, step: int) -> int | None:
        """Before step `step` + 1: the stage's length; returns it where it changed (and at the first call), else
        None; always None without stages."""
        if not self.stages:
            return None
        frac = step / self.total_steps
        length = next((n for until, n in self.stages if frac < until), self.seq_len)
        changed, self.length = length != self.length, length
        return length if changed else None

    def map(self, batch: dict) -> dict:
        return cut_rows(batch, self.length or self.seq_len)
