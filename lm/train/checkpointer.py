"""A run's checkpoints: when they are written and the training state they carry (checkpoint.py writes and verifies
the folders).

    checkpoints = Checkpointer(cfg, total_steps=..., tokens_per_step=..., engine=engine, reader=reader, dist=dist,
                               logger=logger, state=state, last_saved=resumed_step)
    if checkpoints.due(step, stop_at): checkpoints.save(step)

Every checkpoint.every_steps steps (not after a skipped step: the last K kept are good ones), and at the end
(checkpoint.at_end, or a stop signal). client.json holds step, tokens, total steps, ranks, engine, the NaN policy's
count, the curriculum phase and its solver settings, the training time and the config.
"""
from __future__ import annotations

from pathlib import Path

from . import checkpoint as ckpt


class Checkpointer:
    """`state()` -> dict: the loop's part of client.json at the time of a save (the phase, the NaN count, the
    training time)."""

    def __init__(self, cfg, *, total_steps: int, tokens_per_step: int, engine, reader, dist, logger, state,
                 last_saved: int = -1):
        self.cfg, self.total_steps, self.tokens_per_step = cfg, total_steps, tokens_per_step
        self.engine, self.reader, self.dist, self.logger, self.state = engine, reader, dist, logger, state
        self.root = ckpt.checkpoints_root(cfg.run_dir)
        self.last_saved = last_saved  # the step of the last checkpoint (a resumed run: the one it resumed), or -1

    def due(self, step: int, stop_at: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return bool(every and step % every == 0 and step < stop_at)

    def save(self, step: int) -> Path:
        client = {"step": step, "tokens": step * self.tokens_per_step, "total_steps": self.total_steps,
                  "world_size": self.dist.world, "engine": self.dist.engine, **self.state(),
                  "train_config": self.cfg.to_dict()}
        path = ckpt.save(self.root, step, engine=self.engine, reader=self.reader, dist=self.dist,
                         keep_last=self.cfg.checkpoint.keep_last, client=client)
        self.logger.log({"event": "checkpoint", "step": step, "path": str(path), "phase": client["phase"]})
        self.last_saved = step
        return path

    def path_of(self, step: int) -> Path:
        return self.root / ckpt.tag_of(step)
