"""The input-gradient GEMMs of Llama-350M's input projections (qkv_proj; gate and up) at micro 16 x 2048, bf16: what
a step skips when the norm before them passes no gradient back (the dead products are eliminated)."""
import torch
import triton

M, K, L = 16 * 2048, 1024, 24
tot = 0.0
for name, n in (("qkv_proj", 3072), ("gate_proj+up_proj", 5632)):
    dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: dy @ w, warmup=50, rep=300, return_mode="median")
    tot += ms
    print(f"dX of {name}: {ms:.3f} ms per layer ({2 * M * n * K / ms / 1e9:.0f} TFLOP/s)")
print(f"per step ({L} layers): {L * tot:.1f} ms")
