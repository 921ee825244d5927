"""Every family's model under context parallelism (lm.models.context_parallel) on 2 gloo ranks (the hybrid and
FP-Mamba on 4 too: CASES) against the unsharded model: hidden states of each rank's slice, the loss (the ranks' mean),
every parameter's gradient (summed over the ranks, divided by their number), and an implicit model's iteration count;
float64 to 1e-10 and float32 to 1e-5, rows of a batch and packed documents (tests/test_context_parallel_ops.py's
offsets). Anderson acceleration solves a least-squares problem per iteration (condition numbers ~1e4 here) from inner
products that the ranks sum in another order than one rank does: its float64 results agree to ~1e-8, so that case is
held to 1e-7, and it runs in float64 only: the tiny model's solve does not converge in its 30 iterations (residual
~1e-2) and Anderson's step amplifies rounding there (the unsharded float32 run differs from the float64 one by 0.8%
after 30 iterations, 19% after 80; the plain damped solve by 5e-7), so no float32 run of it, sharded or not, is
reproducible to 1e-5."""
from __future__ import annotations

import pytest
import torch
from context_parallel_checks import assert_passed, case_params, check, close, label, run_selected, summed
from test_context_parallel_ops import OFFSETS, T

from lm.models import MODEL_TYPES
from lm.models.context_parallel import ContextShard
from lm.models.presets import load_config

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)
MAMBA2 = dict(d_state=8, headdim=8, chunk_size=8, expand=2)
FAMILIES = {
    "llama": ("lm_llama-tiny", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)),
    "llama_window": ("lm_llama-tiny", dict(num_attention_heads=4, intermediate_size=48, sliding_window=5)),
    "mamba2": ("lm_mamba2-tiny", MAMBA2),
    "deltaproduct": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=8, chunk_size=16, use_forget_gate=True,
                                                  use_output_gate=True, intermediate_size=48)),
    "lru": ("lm_lru-tiny", dict(intermediate_size=48, chunk_size=4)),
    "hlru": ("lm_lru-tiny-hlru", dict(intermediate_size=48, num_states=8, chunk_size=4)),
    "bdlru": ("lm_lru-tiny-bdlru", dict(intermediate_size=48, num_states=8, block_size=3, chunk_size=4)),
    "fp_mamba": ("lm_fp_mamba-tiny", dict(MAMBA2, layer_solver={"max_iter": 30, "tol": 1e-3})),
    "hybrid": ("lm_hybrid-tiny", dict(layer_pattern="M*DB", num_hidden_layers=4, intermediate_size=48,
                                      attention={"num_attention_heads": 4, "num_key_value_heads": 2,
                                                 "sliding_window": 7},
                                      mamba2=MAMBA2, deltaproduct={"num_heads": 2, "head_dim": 8, "chunk_size": 16},
                                      bdlru={"num_states": 8, "block_size": 2, "chunk_size": 4})),
    "mamba2_implicit": ("lm_mamba2-tiny", dict(MAMBA2, implicit={"max_iter": 30, "tol": 1e-4, "phantom_steps": 2})),
    "mamba2_anderson": ("lm_mamba2-tiny", dict(MAMBA2, implicit={"max_iter": 30, "tol": 1e-4, "phantom_steps": 1,
                                                                 "anderson": 2})),
    "hybrid_implicit": ("lm_hybrid-tiny", dict(layer_pattern="*M", num_hidden_layers=2, intermediate_size=48,
                                               attention={"num_attention_heads": 2}, mamba2=MAMBA2,
                                               implicit={"max_iter": 30, "tol": 1e-4, "phantom_steps": 1})),
}


def _model(family, dtype):
    preset, over = FAMILIES[family]
    torch.manual_seed(0)
    config = load_config(preset, **{**SMALL, **over})
    model = MODEL_TYPES[config.model_type][2](config).to(dtype)
    model.train()
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_family(rank, world, family):
    for dtype in (torch.float64,) if family == "mamba2_anderson" else (torch.float64, torch.float32):
        for packed in (False, True):
            with label(f"{str(dtype)[6:]} packed={packed}"):
                _check(rank, world, family, dtype, packed)


def _check(rank, world, family, dtype, packed, checkpointing=False):
    model = _model(family, dtype)
    if checkpointing:  # the blocks' forwards, collectives included, run again in the backward on every rank
        model.gradient_checkpointing_enable()
        check(model.model.gradient_checkpointing, "gradient checkpointing is not on")
    g = torch.Generator().manual_seed(1)
    b = 1 if packed else 2
    ids = torch.randint(0, 64, (b, T), generator=g)
    targets = torch.randint(0, 64, (b, T), generator=g)
    targets[:, 3] = -100  # an ignored target (on rank 0's slice): the group's token count is used
    cu = torch.tensor(OFFSETS, dtype=torch.int32) if packed else None

    hidden = {}
    model.model.register_forward_hook(lambda m, args, out: hidden.__setitem__("h", out[0]))
    out = model(ids, targets=targets, cu_seqlens=cu, fused_loss=True)
    out.loss.backward()
    ref, ref_h, ref_loss, ref_stats = _grads(model), hidden["h"].detach(), out.loss.detach(), out.fixed_point_stats
    model.zero_grad(set_to_none=True)

    shard = ContextShard.of(None, T, OFFSETS if packed else None)
    part = shard.part
    out = model(ids[:, part], targets=targets[:, part], context=shard, fused_loss=True)
    out.loss.backward()
    tight = 1e-7 if family == "mamba2_anderson" else 1e-10
    close("hidden", hidden["h"], ref_h[:, part], dtype, tight)
    close("loss", summed(out.loss) / world, ref_loss, dtype, tight)
    grads = _grads(model)
    check(grads.keys() == ref.keys(), f"parameters with gradients differ: {sorted(set(grads) ^ set(ref))}")
    for n in ref:  # the same model on every rank: the same names, the same all-reduces
        if n in grads:
            close(n, summed(grads[n]) / world, ref[n], dtype, tight)
    if ref_stats is not None:
        for key in ("iterations", "layer_iterations"):
            if key in ref_stats:
                check(out.fixed_point_stats[key] == ref_stats[key],
                      f"{key}: {out.fixed_point_stats[key]}, unsharded {ref_stats[key]}")


def _check_checkpointing(rank, world, family):
    """model.activation_checkpointing with context parallelism: each block's recomputed forward repeats its
    exchanges between the ranks, in the same order on all of them."""
    for packed in (False, True):
        with label(f"float64 packed={packed}"):
            _check(rank, world, family, torch.float64, packed, checkpointing=True)


# Every family at 2 ranks. At 4 ranks (slices of 12 tokens: a packed document covers a whole slice, which then hands
# its entering state on, and attention gathers keys from two ranks back): the hybrid, whose layers are attention,
# Mamba2, DeltaProduct and the block-diagonal LRU, and FP-Mamba, whose per-layer solve stops on the residual reduced
# over the group (it converges here) and whose token shift takes the previous rank's last token.
CASES = {2: {**{family: (_check_family, (family,)) for family in FAMILIES},
             **{f"{family}_checkpointing": (_check_checkpointing, (family,)) for family in ("hybrid", "fp_mamba")}},
         4: {family: (_check_family, (family,)) for family in ("hybrid", "fp_mamba")}}


@pytest.fixture(scope="module")
def reports(request):
    """Every selected case, in one start of 2 ranks and one of 4."""
    return run_selected(request, CASES)


@pytest.mark.multirank
@pytest.mark.parametrize("world, case", case_params(CASES))
def test_model_equals_unsharded(reports, world, case):
    """Hidden states, loss, parameter gradients and iteration counts of the family's model (`_checkpointing`: with
    activation checkpointing) against the unsharded model."""
    assert_passed(reports, world, case)
