"""Context parallelism in training (`train.context_parallel=N`): the ranks split into context groups of N that share
each micro-batch's sequences, each rank holding a contiguous slice of every sequence.

    groups = ContextGroups(cfg.train.context_parallel, dist)     # after the process group exists
    reader = groups.reader(reader)                                 # each rank: its slice of its group's batch

Ranks r N ... r N + N - 1 form context group r; the data readers run with the group's index as their rank and the
number of groups as their world size (`data_rank`, `data_world`), so the ranks of a group read the same batch, and
each keeps its slice of every row (with packed documents, of the (1, B*T) packed row: its documents' offsets go with
it, lm.models.context_parallel.ContextShard). The model runs the slice with the shard (`context=`), and its loss is
the rank's part of the group's token mean times N (group_loss), so that the ranks' gradients summed over the group are
the unsharded sequences' gradient. The optimizer's all-reduce (DeepSpeed ZeRO over all ranks, as data parallelism)
averages over the world, N ranks per group: the averaged gradient is the data-parallel mean of the groups' gradients,
what N-times fewer ranks without context parallelism compute for the same batches. A step holds micro_batch_size *
seq_len * data_world tokens per micro-batch (lm.train.trainer.Plan).
"""
from __future__ import annotations

import torch.distributed as dist

from lm.models.context_parallel import ContextShard

from .data import MappedReader


class ContextGroups:
    """The world's context groups (see the module docstring). n == 1: no groups, every rank its own data rank."""

    def __init__(self, n: int, world: int, rank: int):
        if n < 1 or world % n:
            raise ValueError(f"train.context_parallel: {n} does not divide the {world} ranks; use a divisor of the "
                             "world size (4 ranks: 1, 2 or 4)")
        self.n, self.world, self.rank = n, world, rank
        self.data_world, self.data_rank = world // n, rank // n
        self.group = None
        if n > 1:
            for g in range(world // n):  # every rank creates every group (torch.distributed.new_group's contract)
                pg = dist.new_group(list(range(g * n, (g + 1) * n)))
                if g == self.data_rank:
                    self.group = pg

    @property
    def active(self) -> bool:
        return self.n > 1

    def shard(self, batch: dict) -> dict:
        """A reader batch ({"input_ids", "targets"} (B, T), "cu_seqlens" optional), the same on every rank of the
        group -> this rank's slice {"input_ids", "targets", "context": ContextShard}."""
        if not self.active:
            return batch
        ids, targets = batch["input_ids"], batch["targets"]
        if "cu_seqlens" in batch:  # packed documents: the (1, B*T) packed row is the sequence
            ids, targets = ids.reshape(1, -1), targets.reshape(1, -1)
            shard = ContextShard.of(self.group, ids.shape[1], batch["cu_seqlens"].tolist())
        else:
            shard = ContextShard.of(self.group, ids.shape[1])
        return {"input_ids": ids[:, shard.part], "targets": targets[:, shard.part], "context": shard}

    def reader(self, reader):
        """`reader` yielding this rank's slices (ShardedReader); itself without context parallelism."""
        return ShardedReader(reader, self) if self.active else reader

    def val(self, make_val):
        """make_val(max_batches) -> batches, each sliced for this rank."""
        if not self.active:
            return make_val
        return lambda max_batches: [self.shard(b) for b in make_val(max_batches)]


class ShardedReader(MappedReader):
    """A training reader whose batches are sliced for this rank (ContextGroups.shard)."""

    def __init__(self, reader, groups: ContextGroups):
        super().__init__(reader)
        self.groups = groups

    def map(self, batch: dict) -> dict:
        return self.groups.shard(batch)


def check_context_parallel(cfg) -> None:
    """Refusals of train.context_parallel that need only the config."""
    n = cfg.train.context_parallel
    if n == 1:
        return
    if cfg.data.source == "task":
        raise ValueError("train.context_parallel: a synthetic task's batches change length from batch to batch; train "
                         "them without context parallelism (train.context_parallel=1)")
    if cfg.data.seq_len % n:
        raise ValueError(f"train.context_parallel: data.seq_len {cfg.data.seq_len} is not a multiple of {n}: every "
                         "rank of a context group holds seq_len / context_parallel tokens of each sequence")
    if cfg.train.engine == "torch":
        raise ValueError("train.context_parallel: needs several ranks (train.engine=deepspeed or auto, launched with "
                         "torchrun / deepspeed)")


def moved(batch: dict, move) -> dict:
    """A sliced batch with its tensors moved to the device (`move`), the shard as it is."""
    return {"input_ids": move(batch["input_ids"]), "targets": move(batch["targets"]), "context": batch["context"]}

