"""The trainer's data: lm.data's TrainReader/ValReader over prepared shards, synthetic tokens, or a synthetic
task (data.source=task: lm.data.synthetic.source.TaskReader, build_task_data).

    train_reader, val_reader_fn, tokenizer = build_data(cfg.data, seed, micro_batch_size, rank, world_size)

The synthetic source (benchmarks, smoke tests) is a random walk over token ids: each next id is the
previous one plus 1, 2 or 3 (mod synthetic_vocab), so the loss falls towards ln 3. It resumes exactly
(its state is the number of windows consumed, as the shard reader's).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lm_kernels.varlen import packed_offsets


def prepare_command(path: str) -> str:
    source = "shakespeare" if Path(path).name == "shakespeare" else "SOURCE"
    return f"lm prepare-data --input {source} --output {path}"


class SyntheticReader:
    def __init__(self, vocab: int, seq_len: int, micro_batch_size: int, seed: int, rank: int, world_size: int,
                 split: str = "train"):
        self.vocab, self.seq_len, self.micro_batch_size = vocab, seq_len, micro_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.salt = 0 if split == "train" else 1
        self.consumed = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        b, t = self.micro_batch_size, self.seq_len
        first = self.consumed + self.rank * b
        rows = []
        for w in range(first, first + b):
            g = np.random.default_rng([self.seed, self.salt, w])
            steps = g.integers(1, 4, size=t)
            start = g.integers(0, self.vocab)
            rows.append((start + np.concatenate([[0], np.cumsum(steps)])) % self.vocab)
        buf = np.stack(rows).astype(np.int64)
        self.consumed += b * self.world_size
        return {"input_ids": torch.from_numpy(buf[:, :-1].copy()), "targets": torch.from_numpy(buf[:, 1:].copy())}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len, "synthetic": self.vocab}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "seq_len", "synthetic"):
            if state.get(k) != self.state_dict()[k]:
                raise ValueError(f"cannot resume the synthetic data: checkpoint has {k}={state.get(k)!r}, "
                                 f"this run has {self.state_dict()[k]!r}")
        self.consumed = int(state["consumed"])


def build_data(data_cfg, *, seed: int, micro_batch_size: int, rank: int, world_size: int):
    """(train reader, make_val(max_batches) -> iterable of batches, tokenizer or None, vocab size of the data)."""
    if data_cfg.source == "synthetic":
        train = SyntheticReader(data_cfg.synthetic_vocab, data_cfg.seq_len, micro_batch_size, seed, rank, world_size)

        def make_val(max_batches):
            r = SyntheticReader(data_cfg.synthetic_vocab, data_cfg.seq_len, micro_batch_size, seed, rank,
                                world_size, split="val")
            return [next(r) for _ in range(max_batches)]

        return train, make_val, None, data_cfg.synthetic_vocab

    if data_cfg.source == "task":
        raise ValueError("data.source=task: build the reader with build_task_data(cfg, ...) (it needs the task section)")
    from lm.data import TokenDataset, TrainReader, ValReader, load_tokenizer

    path = Path(data_cfg.path)
    if not (path / "metadata.json").is_file():
        raise ValueError(f"data.path: no prepared data in {path}. Prepare it first with:\n"
                         f"    {prepare_command(str(path))}\n"
                         "or point data.path at a folder made by `lm prepare-data`.")
    ds = TokenDataset(path, "train")
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    ds.check_tokenizer(tokenizer)
    train = TrainReader(ds, data_cfg.seq_len, micro_batch_size, seed=seed, rank=rank, world_size=world_size,
                        cu_seqlens=data_cfg.cu_seqlens)
    val_ds = TokenDataset(path, "val") if "val" in ds.metadata["splits"] else None

    def make_val(max_batches):
        if val_ds is None or val_ds.num_tokens < 2:
            return []
        return ValReader(val_ds, data_cfg.seq_len, micro_batch_size, rank=rank, world_size=world_size,
                         cu_seqlens=data_cfg.cu_seqlens, max_batches=max_batches)

    return train, make_val, tokenizer, ds.vocab_size


def build_task_data(cfg, *, rank: int, world_size: int):
    """data.source=task: (TaskReader over cfg.task, make_val -> [] (no held-out loss: the task is evaluated per
    length by lm.eval.synthetic), no tokenizer, the task's vocabulary size)."""
    from lm.data.synthetic.registry import build_task
    from lm.data.synthetic.source import TaskReader

    k = cfg.task
    task = build_task(k.name, **k.params)
    reader = TaskReader(task, tuple(k.lengths or task.train_lengths), cfg.train.micro_batch_size, cfg.train.seed,
                        examples=k.examples, rank=rank, world_size=world_size, prefetch=k.prefetch)
    return reader, lambda max_batches: [], None, task.vocab_size


def to_model_inputs(batch: dict, device: torch.device) -> dict:
    """Reader batch -> model kwargs; packed documents (cu_seqlens) are laid out as one (1, B*T) row. On CUDA the
    tensors go through pinned memory, so that their copies are queued without waiting for the device.

    Packed offsets still on the host (as the readers yield them) are checked here, before their copy, and go with
    the longest document's length as `max_seqlen` and with their host tensor as `cu_seqlens_cpu` (what ops that need
    the offsets' values on the host read, DeltaProduct's chunk tables): the model then reads nothing back from the
    device in its forward (LMModel.forward), which would otherwise wait there for the step queued before."""
    def move(t):
        if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    if "context" in batch:  # this rank's slice of its context group's batch (lm.train.context_parallel)
        from .context_parallel import moved

        return moved(batch, move)
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"]
        # (offsets already on a device are left to the model to check, which waits for the device)
        extra = {}
        if cu.device.type == "cpu":
            extra["max_seqlen"], extra["cu_seqlens_cpu"] = packed_offsets(cu, 1, batch["input_ids"].numel(), "data")
        return {"input_ids": move(batch["input_ids"]).reshape(1, -1), "targets": move(batch["targets"]).reshape(1, -1),
                "cu_seqlens": move(cu), **extra}
    return {"input_ids": move(batch["input_ids"]), "targets": move(batch["targets"])}


class MappedReader:
    """A training reader whose batches pass through `map` on the way out (the sequence-length warm-up's cut rows,
    context parallelism's slices); its state (resume) and its other attributes are the wrapped reader's."""

    def __init__(self, reader):
        self.inner = reader

    def map(self, batch: dict) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.map(next(self.inner))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name):
        return getattr(self.inner, name)
