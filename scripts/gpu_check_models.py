"""GPU check: every family trains through the Triton kernels and matches the CPU reference loss.

For each model type (explicit and implicit) the same weights and batch run
  - on CPU in float32 through the PyTorch references (the CI path), and
  - on CUDA in bf16 autocast through the Triton kernels (asserted to be the dispatched backend),
for a few AdamW steps; the losses must agree within bf16 tolerance at every step.

    python scripts/gpu_check_models.py [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import lm  # noqa: F401
from lm.models.presets import load_config

CASES = [
    ("lm_mamba2-tiny", None),
    ("lm_mamba2-tiny", dict(max_iter=4, phantom_steps=1)),
    ("lm_llama-tiny", None),
    ("lm_deltaproduct-tiny", None),
    ("lm_deltaproduct-tiny", dict(max_iter=4, phantom_steps=1)),
    ("lm_lru-tiny-bdlru", None),
    ("lm_lru-tiny", None),
    ("lm_fp_mamba-tiny", None),
]


def run_steps(model, batches, device, bf16: bool, steps: int):
    from transformers import AutoModelForCausalLM  # noqa: F401

    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches[:steps]:
        ids = ids.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    assert torch.cuda.is_available(), "needs a GPU"
    rows = []
    ok_all = True
    for preset, implicit in CASES:
        try:
            cfg = load_config(preset, implicit=implicit)
        except ValueError as e:  # preset not built
            rows.append({"preset": preset, "implicit": implicit, "error": str(e)[:200]})
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, cfg.vocab_size, (4, args.seq_len), generator=g) for _ in range(args.steps)]
        t0 = time.time()
        cpu = run_steps(copy.deepcopy(model), batches, "cpu", False, args.steps)
        t1 = time.time()
        gpu = run_steps(copy.deepcopy(model), batches, "cuda", True, args.steps)
        torch.cuda.synchronize()
        t2 = time.time()
        rel = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu))
        ok = rel < 2e-2
        ok_all &= ok
        rows.append({"preset": preset, "implicit": implicit, "cpu_fp32_losses": cpu, "gpu_bf16_losses": gpu,
                     "max_rel_diff": rel, "ok": ok, "cpu_s": t1 - t0, "gpu_s": t2 - t1})
        print(f"{preset:24s} {'implicit' if implicit else 'explicit':9s} cpu {['%.4f' % x for x in cpu]} "
              f"gpu {['%.4f' % x for x in gpu]} max rel diff {rel:.2e} {'OK' if ok else 'MISMATCH'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name()}, f, indent=2)
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
