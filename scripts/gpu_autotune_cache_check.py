"""GPU check of the autotuners' disk cache (lm_kernels/autotune.py): run this in several processes that share one
TRITON_CACHE_DIR; each prints the first SSD forward + backward's wall time (compile + autotune + run), the config
every SSD autotuner chose and a checksum of y and dx. The second process should be faster (no timing of configs),
choose the same configs (maxnreg included) and give bitwise the same numbers.

    export TRITON_CACHE_DIR=$(mktemp -d)
    python scripts/gpu_autotune_cache_check.py; python scripts/gpu_autotune_cache_check.py
    LM_TRITON_AUTOTUNE_CACHE=0 python scripts/gpu_autotune_cache_check.py   # kernels cached, configs timed again
"""
from __future__ import annotations

import json
import time

import torch

from lm.benchmarks.ssd import SHAPES, make_inputs, ours_fn


def main():
    from triton.runtime.autotuner import Autotuner

    import lm_kernels.ssd.launch as ln
    from lm_kernels.autotune import cache_enabled
    shape = SHAPES["B8_T2048"]
    inp = {k: v.detach().clone().requires_grad_() for k, v in make_inputs(shape, "cuda", torch.bfloat16).items()}
    gy = torch.randn(shape[0], shape[1], shape[2], shape[3], device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator(device="cuda").manual_seed(3))
    f = ours_fn(inp, shape[-1])
    torch.cuda.synchronize()
    t = time.perf_counter()
    y = f()
    y.backward(gy)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    t = time.perf_counter()
    f().backward(gy)
    torch.cuda.synchronize()
    second = time.perf_counter() - t
    chosen = {name: str(o.best_config) for name, o in vars(ln).items()
              if isinstance(o, Autotuner) and getattr(o, "best_config", None) is not None}
    print(json.dumps(dict(cache=cache_enabled(), first_call_s=round(first, 2), second_call_s=round(second, 4),
                          y_sum=float(y.float().sum()), dx_sum=float(inp["x"].grad.float().sum()), chosen=chosen)))


if __name__ == "__main__":
    main()
