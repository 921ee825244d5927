"""Reading prepared shards for training and evaluation.

    ds = TokenDataset("data/shakespeare", "train")       # metadata + memmapped shards of one split
    ds.check_tokenizer(tokenizer)                        # refuse shards made with another tokenizer
    ds.check_vocab(model.config.vocab_size)              # ids must fit the model's embedding
    reader = TrainReader(ds, seq_len=512, micro_batch_size=8, seed=0, rank=r, world_size=w)
    batch = next(reader)     # {"input_ids": (B, T) int64, "targets": (B, T) int64}
    state = reader.state_dict(); ...; reader.load_state_dict(state)   # exact resume
    for batch in ValReader(TokenDataset("data/shakespeare", "val"), 512, 8, rank=r, world_size=w): ...

**Windows and targets.** The split's shards are read as one token stream (documents separated by
EOS; windows cross document and shard boundaries: packed training). Window i holds the seq_len+1
tokens starting at i*seq_len (consecutive windows share one token, so every token but the first is a
target exactly once per epoch); there are (num_tokens - 1) // seq_len windows. A batch row is one
window w: ``input_ids = w[:-1]`` and ``targets = w[1:]`` -- the targets are *already shifted*, so the
loss is ``cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)`` computed by
the trainer itself. (Do not pass ``targets`` as a Hugging Face ``labels=`` argument: HF models shift
labels internally and would drop/misalign one token.)

**Order.** Each epoch visits every window exactly once, in the order of a seeded permutation
(``lm.data.permutation``: pointwise, O(1) memory); epoch e uses keys from (seed, e). The reader keeps
one number, ``consumed``: windows handed out so far by all ranks together. Global position p maps to
epoch p // num_windows and window permute(p % num_windows). A step takes world_size*B positions;
rank r takes positions [consumed + r*B, consumed + (r+1)*B), so ranks get disjoint windows and a
batch may straddle two epochs (no window is dropped or repeated within an epoch).

**Resume.** ``state_dict()`` = {consumed, seed, seq_len, num_tokens, vocab_hash, ...}; after
``load_state_dict`` the next batch is the one that would have come. The state does not depend on the
rank, so every rank may load rank 0's state; world_size and micro_batch_size may change on resume
(the stream of global positions goes on), seed / seq_len / data may not (a ValueError says which).

**Packed documents.** With ``cu_seqlens=True`` a batch also has ``cu_seqlens`` (int32, 1-D): the
boundaries of the documents in the flattened (1, B*T) layout of ``input_ids`` -- 0, each row start,
the position after every EOS token, and B*T -- for varlen kernels (``mixer(x, cu_seqlens=...)``).

**Validation.** ``ValReader`` walks the held-out split in order, windows at stride seq_len covering
every token once (the last window is shorter); the rows are dealt out as global batches of
world_size*B windows, rank r taking rows [r*B, (r+1)*B). Rows past the end of the split and the tail
of the last short window are padded: ``input_ids`` with EOS, ``targets`` with -100. Every rank yields
the same number of batches, all of shape (B, T).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from lm.data.permutation import epoch_key, permute
from lm.data.shards import DTYPES, read_metadata
from lm.data.tokenizer import check_identity, load_tokenizer, tokenizer_identity

IGNORE_INDEX = -100
STATE_VERSION = 1
_BLOCK = 8192  # window indices are computed (vectorized) for this many global positions at once


class TokenDataset:
    """One split of a prepared folder: its metadata and the concatenation of its shards (memmapped)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        self.data_dir = Path(data_dir)
        self.metadata = read_metadata(self.data_dir)
        splits = self.metadata["splits"]
        if split not in splits:
            raise ValueError(f"{data_dir} has no split {split!r} (splits: {sorted(splits)})")
        self.split = split
        config = self.metadata["config"]
        self.tokenizer_identity: dict = config["tokenizer"]
        self.vocab_size: int = self.tokenizer_identity["vocab_size"]
        self.eos_token_id: int = self.tokenizer_identity["eos_token_id"]
        self.dtype = np.dtype(DTYPES[config["dtype"]])
        self.shards: list[np.ndarray] = []
        sizes = []
        for shard in splits[split]["shards"]:
            path = self.data_dir / shard["file"]
            want = shard["num_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != want:
                raise ValueError(f"shard {path} is missing or not {want} bytes as its metadata says; prepare the data again")
            # a plain ndarray view of the map: slicing np.memmap objects is several times slower
            self.shards.append(np.memmap(path, dtype=self.dtype, mode="r").view(np.ndarray))
            sizes.append(shard["num_tokens"])
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])
        self.num_documents = int(splits[split]["num_documents"])

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.data_dir)!r}, {self.split!r}: {self.num_tokens:,} tokens, "
                f"{self.num_documents:,} documents, {len(self.shards)} shards, {self.dtype.name})")

    def read(self, start: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream (across shards), into ``out`` if given."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        if out is None:
            out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            local = start + filled - int(self.offsets[k])
            take = min(length - filled, len(self.shards[k]) - local)
            out[filled:filled + take] = self.shards[k][local:local + take]
            filled += take
            k += 1
        return out

    def documents(self):
        """Yield each document's tokens (without its EOS), in order (for inspection and tests)."""
        carry = np.empty(0, dtype=np.int64)
        for shard in self.shards:
            tokens = np.concatenate([carry, np.asarray(shard, dtype=np.int64)])
            ends = np.flatnonzero(tokens == self.eos_token_id)
            begin = 0
            for end in ends:
                yield tokens[begin:end]
                begin = end + 1
            carry = tokens[begin:]

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ValueError unless ``tokenizer`` (object, name/path, or identity dict) made these shards."""
        if isinstance(tokenizer, dict):
            identity = tokenizer
        else:
            tok = load_tokenizer(tokenizer) if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
            identity = tokenizer_identity(tok, getattr(tok, "name_or_path", None) or str(tokenizer))
        check_identity(self.tokenizer_identity, identity, what=f"shards in {self.data_dir}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if the model's vocab_size cannot embed every token id of these shards."""
        if vocab_size < self.vocab_size:
            raise ValueError(
                f"the model's vocab_size {vocab_size} is smaller than the vocabulary of the tokenizer "
                f"{self.tokenizer_identity['name']!r} ({self.vocab_size}) that prepared {self.data_dir}; "
                f"set vocab_size >= {self.vocab_size} in the model config or prepare the data with the model's tokenizer"
            )


def packed_cu_seqlens(input_ids: np.ndarray, eos_token_id: int, valid: np.ndarray | None = None) -> np.ndarray:
    """Document boundaries (int32) of a (B, T) batch in its flattened (1, B*T) layout.

    Boundaries: every row start, the position after each EOS (a new document starts there), the end of
    each row's valid part (``valid[i]`` tokens; the padding after it is one segment), and B*T.
    """
    b, t = input_ids.shape
    flat = input_ids.reshape(-1)
    cuts = [np.arange(0, b * t + 1, t, dtype=np.int64)]
    after_eos = np.flatnonzero(flat == eos_token_id) + 1
    if valid is not None:
        row, col = np.divmod(after_eos - 1, t)
        after_eos = after_eos[col < valid[row]]
        cuts.append(np.arange(b, dtype=np.int64) * t + valid)
    cuts.append(after_eos)
    return np.unique(np.concatenate(cuts)).astype(np.int32)


class TrainReader:
    """Infinite iterator of training batches from a TokenDataset (see the module docstring)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, cu_seqlens: bool = False):
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len and micro_batch_size must be >= 1, got {seq_len}, {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.dataset, self.seq_len, self.micro_batch_size = dataset, seq_len, micro_batch_size
        self.seed, self.rank, self.world_size, self.cu_seqlens = int(seed), rank, world_size, cu_seqlens
        self.num_windows = (dataset.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the {dataset.split} split of {dataset.data_dir} has {dataset.num_tokens} tokens, "
                             f"fewer than seq_len + 1 = {seq_len + 1}; prepare more data or lower seq_len")
        self.consumed = 0  # windows handed out so far by all ranks together
        self._keys: dict[int, np.ndarray] = {}
        self._block: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    @property
    def global_batch_windows(self) -> int:
        return self.world_size * self.micro_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (0-based)."""
        return self.consumed // self.num_windows

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_windows * self.seq_len

    def window_indices(self, positions: np.ndarray) -> np.ndarray:
        """Window index for each global position (epoch = position // num_windows)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_windows)
        out = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(within[sel], self.num_windows, self._key(int(e)))
        return out

    def _window_range(self, start: int, count: int) -> np.ndarray:
        """window_indices(arange(start, start + count)), from a cache of aligned blocks of positions."""
        parts = []
        while count > 0:
            block = start // _BLOCK
            if self._block[0] != block:
                self._block = (block, self.window_indices(np.arange(block * _BLOCK, (block + 1) * _BLOCK)))
            lo = start - block * _BLOCK
            take = min(count, _BLOCK - lo)
            parts.append(self._block[1][lo:lo + take])
            start, count = start + take, count - take
        return np.concatenate(parts)

    def _key(self, epoch: int) -> np.ndarray:
        if epoch not in self._keys:
            self._keys = {epoch: epoch_key(self.seed, epoch)}
        return self._keys[epoch]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        b, t = self.micro_batch_size, self.seq_len
        first = self.consumed + self.rank * b
        windows = self._window_range(first, b)
        buf = np.empty((b, t + 1), dtype=np.int64)
        for row, w in enumerate(windows):
            self.dataset.read(int(w) * t, t + 1, out=buf[row])
        self.consumed += self.global_batch_windows
        batch = {"input_ids": torch.from_numpy(np.ascontiguousarray(buf[:, :-1])),
                 "targets": torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))}
        if self.cu_seqlens:
            batch["cu_seqlens"] = torch.from_numpy(packed_cu_seqlens(buf[:, :-1], self.dataset.eos_token_id))
        return batch

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "consumed": self.consumed, "epoch": self.epoch, "seed": self.seed,
                "seq_len": self.seq_len, "num_tokens": self.dataset.num_tokens,
                "vocab_hash": self.dataset.tokenizer_identity["vocab_hash"],
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for field in ("version", "seed", "seq_len", "num_tokens", "vocab_hash"):
            if state.get(field) != mine[field]:
                raise ValueError(f"cannot resume the data reader: checkpoint has {field}={state.get(field)!r}, "
                                 f"this reader has {field}={mine[field]!r} (same data, seed and seq_len are needed)")
        self.consumed = int(state["consumed"])


class ValReader:
    """The held-out split in order, every token a target once across ranks (see the module docstring)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, cu_seqlens: bool = False, max_batches: int | None = None):
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len and micro_batch_size must be >= 1, got {seq_len}, {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if dataset.num_tokens < 2:
            raise ValueError(f"the {dataset.split} split of {dataset.data_dir} is empty ({dataset.num_tokens} tokens); "
                             "prepare the data with a larger --val-fraction")
        self.dataset, self.seq_len, self.micro_batch_size = dataset, seq_len, micro_batch_size
        self.rank, self.world_size, self.cu_seqlens = rank, world_size, cu_seqlens
        self.num_windows = -(-(dataset.num_tokens - 1) // seq_len)
        global_batch = world_size * micro_batch_size
        self.num_batches = -(-self.num_windows // global_batch)
        if max_batches is not None:
            self.num_batches = min(self.num_batches, max_batches)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        b, t, n = self.micro_batch_size, self.seq_len, self.dataset.num_tokens
        eos = self.dataset.eos_token_id
        for step in range(self.num_batches):
            buf = np.full((b, t + 1), eos, dtype=np.int64)
            valid = np.zeros(b, dtype=np.int64)  # targets in each row
            for row in range(b):
                w = (step * self.world_size + self.rank) * b + row
                if w >= self.num_windows:
                    break
                start = w * t
                length = min(t + 1, n - start)
                self.dataset.read(start, length, out=buf[row, :length])
                valid[row] = length - 1
            targets = np.ascontiguousarray(buf[:, 1:])
            targets[np.arange(t)[None, :] >= valid[:, None]] = IGNORE_INDEX
            batch = {"input_ids": torch.from_numpy(np.ascontiguousarray(buf[:, :-1])),
                     "targets": torch.from_numpy(targets)}
            if self.cu_seqlens:
                batch["cu_seqlens"] = torch.from_numpy(packed_cu_seqlens(buf[:, :-1], eos, valid))
            yield batch
