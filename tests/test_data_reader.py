"""TrainReader / ValReader / TokenDataset on hand-made shards whose every window is known."""
import json

import numpy as np
import pytest
import torch

from lm.data.permutation import epoch_key, permute
from lm.data.reader import IGNORE_INDEX, TokenDataset, TrainReader, ValReader, packed_cu_seqlens
from lm.data.shards import FORMAT, METADATA, VERSION

EOS = 0


def make_prepared(tmp_path, train_shards, val_shards=(), vocab_size=1000, dtype="uint16", vocab_hash="h"):
    """Write shards + metadata.json in the prepared format; returns the folder."""
    splits = {}
    for split, shards in (("train", train_shards), ("val", val_shards)):
        entries = []
        for k, tokens in enumerate(shards):
            name = f"{split}_{k:05d}.bin"
            np.asarray(tokens, dtype=dtype).tofile(tmp_path / name)
            entries.append({"file": name, "num_tokens": len(tokens), "num_documents": int(np.sum(np.asarray(tokens) == EOS))})
        splits[split] = {"num_tokens": sum(e["num_tokens"] for e in entries),
                         "num_documents": sum(e["num_documents"] for e in entries), "shards": entries, "current": None}
    identity = {"name": "test", "vocab_size": vocab_size, "eos_token": "<e>", "eos_token_id": EOS, "vocab_hash": vocab_hash}
    meta = {"format": FORMAT, "version": VERSION, "complete": True, "splits": splits, "next_doc": 0,
            "config": {"source": {}, "tokenizer": identity, "dtype": dtype, "val_fraction": 0.1, "shard_tokens": 10}}
    (tmp_path / METADATA).write_text(json.dumps(meta))
    return tmp_path


def random_stream(rng, n, vocab=1000, doc_len=(5, 40)):
    """A token stream of documents (ids 1..vocab-1) each ending with EOS."""
    out = []
    while len(out) < n:
        out.extend(rng.integers(1, vocab, size=int(rng.integers(*doc_len))).tolist())
        out.append(EOS)
    return np.array(out[:n], dtype=np.int64)


def split_shards(stream, cuts):
    return [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    stream = random_stream(rng, 1003)
    val = random_stream(rng, 257)
    folder = make_prepared(tmp_path, split_shards(stream, [100, 101, 550]), split_shards(val, [60]))
    return folder, stream, val


def window_id(stream, seq_len, row_input, row_target):
    """The window index whose tokens these are (checks input/target against the stream)."""
    hits = [w for w in range((len(stream) - 1) // seq_len)
            if np.array_equal(stream[w * seq_len:w * seq_len + seq_len], row_input)
            and np.array_equal(stream[w * seq_len + 1:w * seq_len + seq_len + 1], row_target)]
    assert len(hits) >= 1, "row is not a window of the stream"
    return hits[0]


def test_read_across_shards(corpus):
    folder, stream, _ = corpus
    ds = TokenDataset(folder, "train")
    assert ds.num_tokens == len(stream) and len(ds.shards) == 4
    for start, length in [(0, 1003), (95, 10), (99, 3), (100, 1), (98, 500), (1000, 3)]:
        assert np.array_equal(ds.read(start, length), stream[start:start + length])
    with pytest.raises(IndexError):
        ds.read(1000, 4)
    docs = list(ds.documents())
    ends = np.flatnonzero(stream == EOS)
    assert len(docs) == len(ends) and np.array_equal(docs[1], stream[ends[0] + 1:ends[1]])


def test_permutation_is_a_bijection():
    for n in [1, 2, 3, 7, 64, 65, 1000, 4099]:
        for seed in range(3):
            p = permute(np.arange(n), n, epoch_key(seed, 0))
            assert np.array_equal(np.sort(p), np.arange(n))
    a = permute(np.arange(50), 50, epoch_key(0, 0))
    assert not np.array_equal(a, permute(np.arange(50), 50, epoch_key(0, 1)))
    assert not np.array_equal(a, np.arange(50))


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_window_once_per_epoch_and_ranks_disjoint(corpus, world_size):
    folder, stream, _ = corpus
    ds = TokenDataset(folder, "train")
    seq_len, b = 16, 5  # 62 windows: global batches straddle epoch ends
    readers = [TrainReader(ds, seq_len, b, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
    n = readers[0].num_windows
    assert n == (len(stream) - 1) // seq_len
    seen = []  # windows in global-position order
    for _ in range(-(-3 * n // (b * world_size))):  # three epochs and a bit
        step = []
        for reader in readers:
            batch = next(reader)
            assert batch["input_ids"].shape == (b, seq_len) and batch["input_ids"].dtype == torch.int64
            ids = [window_id(stream, seq_len, x.numpy(), y.numpy()) for x, y in zip(batch["input_ids"], batch["targets"])]
            step.extend(ids)
        seen.extend(step)
        if world_size > 1 and readers[0].consumed <= n:  # inside epoch 0: ranks never share a window
            assert len(set(step)) == len(step)
    epochs = [seen[e * n:(e + 1) * n] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]
    assert readers[0].epoch == len(seen) // n


def test_targets_are_inputs_shifted(corpus):
    folder, stream, _ = corpus
    batch = next(TrainReader(TokenDataset(folder), 32, 4, seed=1))
    assert torch.equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])


def test_deterministic_and_seeded(corpus):
    folder, _, _ = corpus
    ds = TokenDataset(folder)
    a = [next(TrainReader(ds, 8, 4, seed=3))["input_ids"] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    assert not torch.equal(a[0], next(TrainReader(ds, 8, 4, seed=4))["input_ids"])


def test_exact_resume(corpus):
    folder, _, _ = corpus
    ds = TokenDataset(folder)
    reader = TrainReader(ds, 16, 3, seed=5, rank=1, world_size=2, cu_seqlens=True)
    for _ in range(13):
        next(reader)
    state = json.loads(json.dumps(reader.state_dict()))  # plain JSON-able values
    expected = [next(reader) for _ in range(30)]  # crosses epoch boundaries
    fresh = TrainReader(TokenDataset(folder), 16, 3, seed=5, rank=1, world_size=2, cu_seqlens=True)
    fresh.load_state_dict(state)
    for want in expected:
        got = next(fresh)
        assert all(torch.equal(got[k], want[k]) for k in want)
    # another world size continues the same global stream (rank 0 of 1 takes what ranks 0 and 1 would have)
    solo = TrainReader(ds, 16, 6, seed=5)
    solo.load_state_dict(state)
    r0 = TrainReader(ds, 16, 3, seed=5, rank=0, world_size=2)
    r0.load_state_dict(state)
    both = next(solo)["input_ids"]
    assert torch.equal(both[:3], next(r0)["input_ids"]) and torch.equal(both[3:], expected[0]["input_ids"])
    with pytest.raises(ValueError, match="seed"):
        TrainReader(ds, 16, 3, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        TrainReader(ds, 8, 3, seed=5).load_state_dict(state)


def brute_cu_seqlens(x, valid=None):
    b, t = x.shape
    cuts = {0, b * t}
    for i in range(b):
        cuts.add(i * t)
        n = t if valid is None else valid[i]
        if valid is not None:
            cuts.add(i * t + n)
        for j in range(t):
            if x[i, j] == EOS and j < n:
                cuts.add(i * t + j + 1)
    return sorted(cuts)


def test_cu_seqlens(corpus):
    folder, _, _ = corpus
    batch = next(TrainReader(TokenDataset(folder), 32, 4, seed=2, cu_seqlens=True))
    x = batch["input_ids"].numpy()
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == brute_cu_seqlens(x)
    assert (x == EOS).sum() > 0  # the check is not vacuous
    x = np.array([[5, EOS, 6, 7], [EOS, 8, EOS, 9]])
    assert packed_cu_seqlens(x, EOS).tolist() == [0, 2, 4, 5, 7, 8]
    assert packed_cu_seqlens(x, EOS, np.array([4, 1])).tolist() == brute_cu_seqlens(x, [4, 1]) == [0, 2, 4, 5, 8]


@pytest.mark.parametrize("world_size,b,seq_len", [(1, 4, 16), (2, 3, 16), (3, 2, 50)])
def test_val_reader_covers_split_once(corpus, world_size, b, seq_len):
    folder, _, val = corpus
    ds = TokenDataset(folder, "val")
    readers = [ValReader(ds, seq_len, b, rank=r, world_size=world_size, cu_seqlens=True) for r in range(world_size)]
    assert len({len(r) for r in readers}) == 1
    rows = []  # (global window index, targets)
    for r, reader in enumerate(readers):
        batches = list(reader)
        assert len(batches) == len(reader)
        assert all(batch["input_ids"].shape == (b, seq_len) for batch in batches)
        for step, batch in enumerate(batches):
            for row in range(b):
                rows.append(((step * world_size + r) * b + row, batch["input_ids"][row], batch["targets"][row]))
        again = list(ValReader(ds, seq_len, b, rank=r, world_size=world_size, cu_seqlens=True))
        assert all(torch.equal(x["targets"], y["targets"]) for x, y in zip(again, batches))
    rows.sort(key=lambda r: r[0])
    targets = torch.cat([t for _, _, t in rows])
    assert torch.equal(targets[targets != IGNORE_INDEX], torch.from_numpy(val[1:]))
    for w, x, t in rows:  # inputs line up with targets
        n = int((t != IGNORE_INDEX).sum())
        assert torch.equal(x[:n], torch.from_numpy(val[w * seq_len:w * seq_len + n]))
    assert len(list(ValReader(ds, seq_len, b, max_batches=1))) == 1


def test_errors(corpus, tmp_path_factory):
    folder, _, _ = corpus
    ds = TokenDataset(folder)
    with pytest.raises(ValueError, match="seq_len"):
        TrainReader(ds, 5000, 2)
    with pytest.raises(ValueError, match="rank"):
        TrainReader(ds, 8, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="vocab_size"):
        ds.check_vocab(999)
    ds.check_vocab(1024)
    good = dict(ds.tokenizer_identity)
    ds.check_tokenizer(good)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        ds.check_tokenizer({**good, "vocab_hash": "other", "name": "gpt2"})
    with pytest.raises(ValueError, match="split"):
        TokenDataset(folder, "test")
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        TokenDataset(folder / "nope")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        TokenDataset(empty)
    (folder / "train_00002.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="train_00002.bin"):
        TokenDataset(folder)
    meta = json.loads((folder / METADATA).read_text())
    meta["complete"] = False
    (folder / METADATA).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unfinished"):
        TokenDataset(folder)


def test_empty_val_split_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    folder = make_prepared(tmp_path, [random_stream(rng, 100)], [])
    with pytest.raises(ValueError, match="val-fraction"):
        ValReader(TokenDataset(folder, "val"), 8, 2)
