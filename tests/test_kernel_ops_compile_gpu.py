"""A Mamba2 block on a GPU as the trainer runs it (float32 weights, bfloat16 autocast, torch.compile'd by inductor,
autotuned Triton conv and SSD as custom ops): one graph with no break, and the compiled block's output and
gradients match eager (fixed-length and packed documents). The CPU twin with the interpreter:
test_kernel_ops_compile.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_mamba2_block_compiled_one_graph_matches_eager(packed, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no graph traced by older op fakes
    import lm  # noqa: F401  (registration)
    from lm.models import LMMamba2Config
    from lm.models.mamba2 import Mamba2Mixer
    from lm.models.modeling import Block

    torch.manual_seed(0)
    cfg = LMMamba2Config(vocab_size=64, hidden_size=256, num_hidden_layers=1, d_state=64, headdim=64, chunk_size=256)
    block = Block(cfg, 0, Mamba2Mixer).cuda()
    shape = (1, 1536) if packed else (2, 768)
    x = torch.randn(*shape, 256, device="cuda", requires_grad=True)
    kw = dict(cu_seqlens=torch.tensor([0, 100, 1100, 1536], dtype=torch.int32, device="cuda")) if packed else {}
    leaves = [x, *block.parameters()]
    gy = torch.randn(*shape, 256, device="cuda")

    def run(f):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = f(x, **kw)
        return y.float().detach(), torch.autograd.grad(y.float(), leaves, gy)

    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(x, **kw)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        [str(r.reason)[:300] for r in explained.break_reasons]
    torch._dynamo.reset()
    y_e, g_e = run(block)
    y_c, g_c = run(torch.compile(block, fullgraph=True))
    torch._dynamo.reset()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()

    assert rel(y_c, y_e) < 1e-2, rel(y_c, y_e)
    worst = max(rel(a, b) for a, b in zip(g_c, g_e))
    assert worst < 5e-2, worst  # bf16: inductor rounds fused intermediates differently from eager
