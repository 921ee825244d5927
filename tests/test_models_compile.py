"""model.compile (torch.compile per block, as the trainer does; the paper recipes set it): the compiled
model gives the eager model's loss and gradients. Llama exercises the rotary tables passed into the
compiled blocks (Mixer.shared_inputs); implicit Mamba2 the fixed-point solver calling compiled blocks (on CPU the
reference conv traced into them, the reference SSD an opaque call; the Triton ones are custom ops inside the graph:
test_kernel_ops_compile.py). The blocks compile with the aot_eager backend: dynamo's graphs and AOTAutograd's forward
and backward, everything but inductor's code generation, which costs minutes on a CPU; inductor runs in the slow tier
(test_train_loop.py::test_compiled_blocks_give_the_same_losses, the trainer's model.compile end to end)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models.presets import load_config


@pytest.mark.parametrize("preset,implicit", [("lm_llama-tiny", None),
                                             ("lm_mamba2-tiny", {"max_iter": 3, "phantom_steps": 1})],
                         ids=["llama", "mamba2-implicit"])
def test_compiled_blocks_match_eager(preset, implicit):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config(preset, implicit=implicit))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads():
        loss = model(ids, labels=ids).loss
        return loss.detach(), torch.autograd.grad(loss, params)

    ref_loss, ref_grads = loss_and_grads()
    from torch._dynamo.utils import counters

    counters.clear()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    loss, grads = loss_and_grads()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs > 0  # the blocks really ran compiled
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    worst = max(((g - r).norm() / r.norm().clamp_min(1e-12)).item() for g, r in zip(grads, ref_grads))
    assert worst < 1e-4, worst
