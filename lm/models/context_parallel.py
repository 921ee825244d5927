"""Context parallelism in the models: this rank's slice of a batch's sequences, attention over the slices, and the
loss of a slice.

    shard = ContextShard.of(group, total=T, offsets=None)     # rank r of the group holds tokens [r T/N, (r+1) T/N)
    out = model(input_ids=ids[:, shard.part], targets=tgt[:, shard.part], context=shard)

Each rank of a context group runs the whole model on its contiguous slice of every sequence (of the packed row with
packed documents: `offsets` are the row's global document offsets, host ints). Token-wise layers need nothing more;
the token mixers pass what crosses a slice border (lm_kernels.context_parallel: the scans' states, the short convs'
halos); attention gathers the keys and values of the group (`attention_cp`); rotary positions are the tokens' global
positions in their documents; an implicit model's solver reduces its residual over the group, so that every rank
iterates as often as the unsharded solve; the loss is the group's token mean (`group_loss`).

Attention (`attention_cp`): an all-gather of every rank's keys and values (exact; memory O(T) per rank, not O(T^2)),
then one SDPA of the slice's first document's queries against its keys from the document's start (earlier ranks'
included) under a causal mask aligned to the bottom right (`causal_lower_right`: the flash / memory-efficient kernels
on CUDA, no mask materialised; a sliding window: a banded boolean mask over the window's keys), and the slice's other
documents, which start inside it, through the local packed path. PyTorch's own context-parallel SDPA
(torch.distributed.tensor.experimental.context_parallel, ring attention) does not run on the CPU (aten's CPU flash op
has no sharding rule, torch 2.13), shards the sequence in a load-balanced order that the recurrent layers' contiguous
slices do not follow, and knows no document masks; the all-gather form is what Llama 3 trained its long contexts
with. Its cost: the last rank attends to every earlier key (causal work grows with the rank; no load balancing).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lm_kernels.context_parallel import ContextSlice, all_gather, slice_offsets
from lm_kernels.varlen import position_in_document


@dataclass
class ContextShard:
    """This rank's slice [start, start + length) of a batch's sequences, and the context group.

    group:   the torch.distributed process group of the ranks that share the sequences (None: the default group).
    start, length: the slice, in tokens of a row.
    offsets: the packed documents' offsets of the whole (1, total) row (host ints, 0 ... total); None for rows of
             independent sequences (b >= 1, each sliced alike).
    """

    group: object
    start: int
    length: int
    offsets: tuple | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.group is None:  # the default group, named: the solver's reductions take None for "no group"
            self.group = dist.group.WORLD

    @classmethod
    def of(cls, group, total: int, offsets=None) -> "ContextShard":
        """Rank r's slice [r total / N, (r + 1) total / N) of rows of `total` tokens (N the group's size)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if total % size:
            raise ValueError(f"context parallelism: the sequence length {total} is not a multiple of the context "
                             f"group's {size} ranks; use a seq_len (times micro_batch_size with packed documents) "
                             "divisible by train.context_parallel")
        n = total // size
        if offsets is not None:
            offsets = tuple(int(o) for o in offsets)
            if offsets[0] != 0 or offsets[-1] != total:
                raise ValueError(f"context parallelism: packed offsets must run from 0 to the row's {total} tokens, "
                                 f"got {offsets[0]} ... {offsets[-1]}")
        return cls(group, rank * n, n, offsets)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def part(self) -> slice:
        """This rank's tokens of a row."""
        return slice(self.start, self.start + self.length)

    @property
    def slice(self) -> ContextSlice:
        """What the ops take (lm_kernels.context_parallel.ContextSlice)."""
        if "slice" not in self._cache:
            if self.offsets is None:
                self._cache["slice"] = ContextSlice(self.group, lead=self.start)
            else:
                lead, local = slice_offsets(self.offsets, self.start, self.length)
                self._cache["slice"] = ContextSlice(self.group, lead=lead, offsets=local)
        return self._cache["slice"]

    def packed(self, device) -> tuple:
        """(cu_seqlens on `device`, the longest local document's length, cu_seqlens on the CPU) of the slice's own
        documents, as the model's packed path takes them; (None, None, None) without packed documents."""
        local = self.slice.offsets
        if local is None:
            return None, None, None
        key = ("packed", str(device))
        if key not in self._cache:
            cpu = torch.tensor(local, dtype=torch.int32)
            longest = max(b - a for a, b in zip(local, local[1:]))
            self._cache[key] = (cpu.to(device), longest, cpu)
        return self._cache[key]

    def positions(self, device) -> torch.Tensor:
        """(length,) every local token's position in its document (or sequence): rotary positions, document starts."""
        sl = self.slice
        if sl.offsets is None:
            return torch.arange(self.start, self.start + self.length, device=device)
        cu = self.packed(device)[0]
        pos = position_in_document(self.length, cu, device)
        first = sl.first_length(self.length)
        return torch.cat([pos[:first] + sl.lead, pos[first:]])


def check_context(context, cache, cu_seqlens, attention_mask) -> None:
    """A forward with context parallelism takes none of a generation cache, its own cu_seqlens or an attention mask."""
    if not isinstance(context, ContextShard):
        raise TypeError(f"context: expected a ContextShard (lm.models.context_parallel), got {type(context).__name__}")
    if cache is not None or attention_mask is not None:
        raise ValueError("context parallelism runs training and evaluation forwards: no generation cache and no "
                         "attention_mask (run generation on one rank, without `context`)")
    if cu_seqlens is not None:
        raise ValueError("context parallelism: packed documents come as the row's global offsets in the ContextShard "
                         "(ContextShard.of(group, total, offsets)), not as cu_seqlens")


def attention_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard, window: int | None,
                 max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention (within a sliding `window` if given) of this rank's queries q (b, h, t, d) to the keys and
    values k, v (b, h_kv, t, d) of every rank up to this one (module docstring); returns (b, h, t, d). q and k carry
    their rotary positions already."""
    sl = shard.slice
    b, hq, t, d = q.shape
    rep = hq // k.shape[1]
    kv = all_gather(torch.stack([k, v]), sl.group)  # (size, 2, b, h_kv, t, d)
    first = sl.first_length(t)
    lead = sl.lead if window is None else min(sl.lead, window - 1)
    keys = kv[sl.rank][..., :first, :]  # this rank's own, from the gathered copy (every rank uses the gather)
    if lead:
        before = kv[:sl.rank].permute(1, 2, 3, 0, 4, 5).reshape(2, b, k.shape[1], sl.rank * t, d)
        keys = torch.cat([before[..., -lead:, :], keys], dim=3)
    kf, vf = keys[0], keys[1]
    if rep > 1:
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    s = kf.shape[2]
    if window is None:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(first, s)
    else:  # query i stands at key index i + s - first; it sees the `window` keys ending there
        i = torch.arange(first, device=q.device).unsqueeze(1) + (s - first)
        j = torch.arange(s, device=q.device)
        mask = (j <= i) & (j > i - window)
    o = F.scaled_dot_product_attention(q[:, :, :first], kf, vf, attn_mask=mask)
    if first == t:
        return o
    from .llama import varlen_causal_attention  # (llama imports this module)

    # the slice's other documents start inside it: the local packed path
    rest = torch.tensor([o_ - first for o_ in sl.offsets[1:]], dtype=torch.int64, device=q.device)
    kr, vr = k[:, :, first:], v[:, :, first:]
    if rep > 1:
        kr, vr = kr.repeat_interleave(rep, dim=1), vr.repeat_interleave(rep, dim=1)
    pos = position_in_document(t - first, rest, q.device)
    longest = max(b_ - a_ for a_, b_ in zip(sl.offsets[1:], sl.offsets[2:]))
    o_rest = varlen_causal_attention(q[:, :, first:], kr, vr, rest, pos, longest, None, window)
    return torch.cat([o, o_rest], dim=2)


def group_loss(loss: torch.Tensor, targets: torch.Tensor, shard: ContextShard, ignore_index: int = -100):
    """This rank's part of the group's token-mean loss, times the group's size: N * (sum over the slice's valid
    targets) / (valid targets in the group). The ranks' values average to the unsharded sequence's mean loss, and their
    gradients, summed over the group (a data-parallel all-reduce averages them over the world), to its gradient.
    `loss`: the slice's own mean (0 or NaN where it has no valid target)."""
    n = (targets != ignore_index).sum()
    total = n.detach().to(torch.float64)
    dist.all_reduce(total, group=shard.group)
    local = torch.where(n > 0, loss, torch.zeros_like(loss))
    return local * (n.to(loss.dtype) * shard.size / total.clamp_min(1).to(loss.dtype))
