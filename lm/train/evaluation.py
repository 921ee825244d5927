"""Evaluation during training: held-out loss / perplexity, lm-eval-harness tasks in process, a text sample.

    ev = Evaluator(cfg.eval, model, make_val, tokenizer, dist, logger, progress, precision=..., seed=..., task=task)
    ev.periodic(step, last_step)     # at eval.every_steps (the synthetic task's evaluation, held-out loss, lm-eval)
    summary.update(ev.final(step))   # at the end (eval.at_end, sample)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import to_model_inputs


def _token_loss_sums(model, inputs: dict) -> tuple[float, float]:
    out = model(input_ids=inputs["input_ids"], cu_seqlens=inputs.get("cu_seqlens"), max_seqlen=inputs.get("max_seqlen"),
                cu_seqlens_cpu=inputs.get("cu_seqlens_cpu"), context=inputs.get("context"))
    t = inputs["targets"]
    loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), t.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return float(loss), float((t != -100).sum())


@torch.no_grad()
def evaluate(model, batches, device, dist, precision: str) -> dict:
    """Held-out loss and perplexity over `batches` (every rank its own; summed over ranks)."""
    was = model.training
    model.eval()
    total = count = 0.0
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
           else torch.autocast(device.type, enabled=False))
    with ctx:
        for batch in batches:
            s, n = _token_loss_sums(model, to_model_inputs(batch, device))
            total, count = total + s, count + n
    total, count = dist.all_reduce_sum([total, count])
    model.train(was)
    if count == 0:
        return {}
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(count)}


def run_tasks(model, tokenizer, ev_cfg, dist) -> dict:
    """The lm-eval hook: the configured tasks in process on rank 0; {"lm_eval/<task>/<metric>": value}."""
    if not ev_cfg.task_list or tokenizer is None:
        return {}
    out = {}
    if dist.is_main:
        from lm.eval.harness import run_lm_eval

        res = run_lm_eval(model, tokenizer, ev_cfg.task_list, num_fewshot=ev_cfg.num_fewshot,
                          batch_size=ev_cfg.tasks_batch_size, limit=ev_cfg.tasks_limit,
                          include_path=ev_cfg.include_path)
        out = {f"lm_eval/{task}/{metric}": v for task, r in res["results"].items() for metric, v in r.items()}
    dist.barrier()
    return out


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    was = model.training
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
    model.train(was)
    return tokenizer.decode(out[0], skip_special_tokens=True)


class Evaluator:
    """The evaluations of eval.* at their steps, logged as events ({"event": "eval" | "lm_eval" | "sample"}); `task`
    (lm.train.synth.task_component): a synthetic task's evaluation per length, also at eval.every_steps."""

    def __init__(self, ev_cfg, model, make_val, tokenizer, dist, logger, progress, *, precision: str, seed: int,
                 tokens_per_step: int, task):
        self.cfg, self.model, self.make_val, self.tokenizer = ev_cfg, model, make_val, tokenizer
        self.dist, self.logger, self.progress, self.task = dist, logger, progress, task
        self.precision, self.seed, self.tokens_per_step = precision, seed, tokens_per_step

    def run(self, step: int) -> dict:
        """Held-out loss and the lm-eval tasks now; returns what was measured."""
        out = evaluate(self.model, self.make_val(self.cfg.batches), self.dist.device, self.dist, self.precision)
        tokens = step * self.tokens_per_step
        if out:
            self.logger.log({"event": "eval", "step": step, "tokens": tokens, **out})
            if self.dist.is_main:
                self.progress.write(f"step {step}: held-out loss {out['val_loss']:.4f}, "
                                    f"perplexity {out['val_ppl']:.2f}")
        tasks = run_tasks(self.model, self.tokenizer, self.cfg, self.dist)
        if tasks:
            self.logger.log({"event": "lm_eval", "step": step, "tokens": tokens, **tasks})
        return {**out, **tasks}

    def due(self, step: int, last_step: int) -> bool:
        return bool(self.cfg.every_steps and step % self.cfg.every_steps == 0 and step < last_step)

    def periodic(self, step: int, last_step: int) -> None:
        if self.due(step, last_step):
            self.task.evaluate(self.model, step, self.logger)
            self.run(step)

    def final(self, step: int) -> dict:
        out = self.run(step) if self.cfg.at_end else {}
        if self.dist.is_main and self.cfg.sample_tokens and self.tokenizer is not None:
            out["sample"] = sample_text(self.model, self.tokenizer, self.cfg.sample_prompt, self.cfg.sample_tokens,
                                        self.seed)
            self.logger.log({"event": "sample", "step": step, "text": out["sample"]})
        return out
