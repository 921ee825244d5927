"""A synthetic task as a training data source: the reader `lm train` uses with `data.source: task`.

    reader = TaskReader(build_task("word_problem", group="S5"), lengths=(32, 32), batch_size=512, seed=0)
    batch = next(reader)   # {"input_ids", "targets", "mask"}: (batch, length) int64 / bool tensors

Each batch has one length, drawn uniformly from `lengths` (inclusive). `targets` is the task's target
per position, -100 where the task has none (the loss ignores it; no next-token shift: the targets are
already aligned with the inputs, as the shard reader's are); `mask` marks the scored positions (the
training accuracy). With `examples` = N the batches are drawn from a fixed training set of N
sequences (MAD style), epoch after epoch, reshuffled each epoch; otherwise every batch is fresh.

Batch i of rank r is a pure function of (seed, i * world_size + r), so the reader resumes exactly from
its state (the number of batches consumed) and ranks never share a batch. `prefetch` > 0 makes the next
batches in a background thread while the device computes (the same batches as without it).
"""
from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from .registry import Task


class TaskReader:
    def __init__(self, task: Task, lengths: tuple[int, int], batch_size: int, seed: int, *,
                 examples: int | None = None, rank: int = 0, world_size: int = 1, prefetch: int = 0):
        lo, hi = (int(n) for n in lengths)
        if not 1 <= lo <= hi:
            raise ValueError(f"task.lengths: must be [min, max] with 1 <= min <= max, got {list(lengths)}")
        if examples is not None and lo != hi:
            raise ValueError(f"task.examples (a fixed training set) needs one training length; "
                             f"got task.lengths {[lo, hi]}")
        self.task, self.lengths, self.batch_size = task, (lo, hi), batch_size
        self.seed, self.examples, self.rank, self.world_size = seed, examples, rank, world_size
        self.prefetch = prefetch
        self.consumed = 0  # batches handed out by this rank
        self.last: dict | None = None  # the batch handed out last (the training-accuracy hook reads it)
        self.pool = task.generate(np.random.default_rng([seed, 2]), examples, lo) if examples else None
        self._queue = self._thread = self._stop = None

    # --- batches -----------------------------------------------------------------------------------
    def make(self, index: int) -> dict:
        """Global batch `index` (rank r of W takes the indices r, r + W, r + 2W, ...)."""
        rng = np.random.default_rng([self.seed, 1, index])
        if self.pool is None:
            length = int(rng.integers(self.lengths[0], self.lengths[1] + 1))
            b = self.task.generate(rng, self.batch_size, length)
        else:
            b = type(self.pool)(*(a[self._pool_rows(index)] for a in self.pool))
        return {"input_ids": torch.from_numpy(b.inputs), "targets": torch.from_numpy(b.targets),
                "mask": torch.from_numpy(b.mask)}

    def _pool_rows(self, index: int) -> np.ndarray:
        """Rows of the fixed set for batch `index`: consecutive slices of per-epoch permutations."""
        n, first = self.examples, index * self.batch_size
        rows, epoch, pos = [], first // n, first % n
        while len(rows) < self.batch_size:
            order = np.random.default_rng([self.seed, 3, epoch]).permutation(n)
            take = order[pos: pos + self.batch_size - len(rows)]
            rows.extend(take)
            epoch, pos = epoch + 1, 0
        return np.asarray(rows)

    def _index(self, k: int) -> int:
        return k * self.world_size + self.rank

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.prefetch <= 0:
            batch = self.make(self._index(self.consumed))
        else:
            if self._thread is None:
                self._start(self.consumed)
            batch = self._queue.get()
            if isinstance(batch, Exception):
                raise batch
        self.consumed += 1
        self.last = batch
        return batch

    # --- background producer -----------------------------------------------------------------------
    def _start(self, first: int) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(first, self._queue, self._stop), daemon=True,
                                        name="task-data")
        self._thread.start()

    def _produce(self, k: int, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = self.make(self._index(k))
            except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
                item = err
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            k += 1

    def close(self) -> None:
        """Stop the background producer (if any); a later next() starts a new one where this one stopped."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._queue = self._thread = self._stop = None

    # --- resume --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "task": self.task.name, "params": self.task.params,
                "lengths": list(self.lengths), "batch_size": self.batch_size, "examples": self.examples}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        diff = [k for k in mine if k != "consumed" and state.get(k) != mine[k]]
        if diff:
            raise ValueError(f"cannot resume the task data: the checkpoint has "
                             f"{', '.join(f'{k}={state.get(k)!r}' for k in diff)}, this run has "
                             f"{', '.join(f'{k}={mine[k]!r}' for k in diff)}; resume with the task settings of "
                             "that run, or start afresh in another run_dir")
        self.close()
        self.consumed = int(state["consumed"])
