"""Test setup shared by every test file.

On a machine without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
any kernel module is imported (triton.jit reads it at decoration time), so it is set here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests use tiny tensors, for which intra-op threads cost more than they give (several-fold on a
# loaded 2-core machine); subprocess tests (DeepSpeed ranks) set their own.
torch.set_num_threads(1)

import pytest  # noqa: E402


# The slow tier besides the tests marked in their files (`@pytest.mark.slow`) and the multirank / install ones: the
# tests that took 15 s or more (about 5 s on an idle machine) in a full run on two busy cores, each family keeping its
# small cases in the fast tier. By kind:
SLOW = {
    # subprocesses: DeepSpeed in a process of its own, the CLI end to end, signals, traces, GPU scripts' dry runs
    "test_train_distributed.py::test_deepspeed_single_process_skips_nan_step_and_reinitialises",
    "test_train_distributed.py::test_deepspeed_step_does_not_synchronise_the_device",
    "test_train_distributed.py::test_deepspeed_bf16_skip_decided_on_the_device",
    "test_train_distributed.py::test_deepspeed_fused_overflow_check_and_grad_norm_equal_deepspeeds[fp32]",
    "test_train_distributed.py::test_deepspeed_fused_overflow_check_and_grad_norm_equal_deepspeeds[bf16]",
    "test_train_resilience.py::test_kill_9_then_resume_leaves_every_step_once_in_metrics",
    "test_train_resilience.py::test_a_second_signal_exits_at_once_with_latest_intact",
    "test_train_resilience.py::test_sigterm_through_the_cli_exits_75",
    "test_train_trace.py::test_profile_of_two_steps",
    "test_train_trace.py::test_sync_needs_cuda",
    "test_synth_run.py::test_gpu_synth_script_slices_and_resumes",
    "test_eval.py::test_lm_eval_cli_on_export",
    "test_eval.py::test_in_process_lm_eval",
    "test_eval.py::test_unknown_local_task_explains",
    "test_eval.py::test_duality_command",
    "test_eval.py::test_generation_task_through_the_static_decode_path",
    "test_left_padding.py::test_lm_eval_generate_until_batch_16_equals_batch_1[mamba2]",
    "test_left_padding.py::test_generate_padded_batch_equals_each_prompt[fp_mamba-implicit-eager]",
    "test_left_padding.py::test_generate_padded_batch_equals_each_prompt[fp_mamba-implicit-static]",
    "test_left_padding.py::test_fused_mamba2_inner_padded",
    "test_left_padding.py::test_float64[fp_mamba-implicit]",
    "test_dev_tools.py::test_saved_cli_json",
    "test_dev_tools.py::test_sm90_stats_script_captures_every_launch_of_forward_and_backward",
    "test_models_loss_triton.py::test_ce_rows_kernel_compiles_for_sm90",
    "test_data_prepare.py::test_hf_dataset_builder_on_local_files",
    "test_bench.py::test_bench_conv1d",
    "test_bench.py::test_bench_ssd_with_a_stand_in_peer",
    "test_bench.py::test_bench_deltaproduct[chunk]",
    "test_bench.py::test_bench_deltaproduct[decode]",
    "test_bench.py::test_bench_lru",
    "test_bench.py::test_bench_generate",
    "test_bench.py::test_bench_data",
    "test_import.py::test_auto_classes_load_lm_models_after_import_lm[lm_first]",
    "test_import.py::test_auto_classes_load_lm_models_after_import_lm[transformers_first]",
    "test_import.py::test_auto_classes_load_lm_models_after_import_lm[modeling_utils_first]",
    "test_import.py::test_no_environment_read_or_written_at_import",
    # training runs: 200 steps against stored losses, models that learn a task
    "test_model_step_losses.py::test_200_steps_same_losses[mamba2]",
    "test_model_step_losses.py::test_200_steps_same_losses[deltaproduct]",
    "test_synth_run.py::test_one_layer_deltaproduct_needs_two_householders_for_s3",
    "test_generate.py::test_parallel_prefill_generation_agrees_with_sequential_on_trained_model",
    "test_models_core.py::test_duality_sequential_vs_simultaneous",
    # opcheck with AOT dispatch over dynamic shapes (one representative case per op stays fast or is named here)
    "test_mamba2_inner.py::test_opcheck[adds_states-False]",
    "test_conv1d_triton.py::test_x_add_opcheck",
    "test_kernel_ops_compile.py::test_opcheck",
    # whole models through the Triton kernels in the interpreter
    "test_conv1d_models.py::test_model_loss_and_grads_triton_equals_reference[mamba2]",
    "test_conv1d_models.py::test_model_loss_and_grads_triton_equals_reference[deltaproduct]",
    "test_conv1d_models.py::test_model_loss_and_grads_triton_equals_reference[mamba2_implicit]",
    "test_conv1d_models.py::test_model_loss_and_grads_triton_equals_reference[deltaproduct_implicit]",
    "test_mamba2_inner.py::test_model_through_the_operator_equals_three_ops[explicit-batch]",
    "test_mamba2_inner.py::test_model_through_the_operator_equals_three_ops[implicit-packed]",
    "test_packed_host_offsets.py::test_packed_step_reads_nothing_back_per_layer[mamba2-triton]",
    "test_packed_host_offsets.py::test_packed_step_reads_nothing_back_per_layer[deltaproduct-triton]",
    "test_packed_host_offsets.py::test_compiled_blocks_take_the_host_offsets[mamba2-triton]",
    "test_packed_host_offsets.py::test_compiled_blocks_take_the_host_offsets[mamba2]",
    "test_packed_host_offsets.py::test_compiled_blocks_take_the_host_offsets[deltaproduct]",
    "test_packed_host_offsets.py::test_compiled_fp_mamba_blocks_hold_no_document_lookup",
    "test_rmsnorm_triton.py::test_generation_with_the_kernel_equals_formula[mamba2]",
    "test_rope_step_triton.py::test_static_decode_with_kernel_equals_reference[implicit1]",
    "test_ssd_step_triton.py::test_mamba2_static_generation_with_the_kernel",
    "test_kernel_ops_compile.py::test_mamba2_block_compiles_as_one_graph[packed]",
    "test_kernel_ops_compile.py::test_ssd_op_compiled_packed_recompile_dynamic",
    # the large interpreter cases of each kernel (the smaller ones of each family stay fast)
    "test_ssd_triton.py::test_triton_odd_sizes_varlen[4-2]",
    "test_ssd_triton.py::test_triton_odd_sizes_varlen[3-1]",
    "test_ssd_triton.py::test_triton_several_tiles_fixed_and_packed[dtype0-2e-05]",
    "test_ssd_triton.py::test_triton_several_tiles_fixed_and_packed[dtype1-0.005]",
    "test_ssd_triton.py::test_triton_whole_chunk_scan_every_partial_chunk_and_fallback",
    "test_ssd_triton.py::test_ssd_scan_xbc_matches_separate_inputs[dtype0-1e-05-False]",
    "test_ssd_triton.py::test_ssd_scan_xbc_matches_separate_inputs[dtype1-0.02-False]",
    "test_ssd_triton.py::test_triton_bf16_products_dA_accuracy",
    "test_mamba2_inner.py::test_folded_norm_matches_the_references[adds_states]",
    "test_mamba2_inner.py::test_folded_norm_matches_the_references[one_group_w3]",
    "test_mamba2_inner.py::test_folded_norm_matches_the_references[packed]",
    "test_mamba2_inner.py::test_inner_bf16_equals_the_three_triton_ops[adds_states]",
    "test_mamba2_inner.py::test_inner_bf16_equals_the_three_triton_ops[packed]",
    "test_mamba2_inner.py::test_inner_matches_composed_references[adds_states]",
    "test_mamba2_inner.py::test_inner_matches_composed_references[packed]",
    "test_mamba2_inner.py::test_inner_matches_composed_references[plain]",
    "test_mamba2_inner.py::test_repeat_calls_skip_the_autotuners",
    "test_conv1d_triton.py::test_bounds_checked_fwd_bwd",
    "test_conv1d_triton.py::test_float64_matches_naive_to_rounding",
    "test_conv1d_triton.py::test_one_pass_backward_crosses_steps_and_chunks[t45w8-state-add-silu-16]",
    "test_conv1d_triton.py::test_one_pass_backward_crosses_steps_and_chunks[t45w8-state-add-silu-18]",
    "test_conv1d_triton.py::test_x_add_equals_conv_of_materialised_sum[False-dtype1]",
    "test_conv1d_triton.py::test_x_add_equals_conv_of_materialised_sum[True-dtype0]",
    "test_conv1d_triton.py::test_x_add_equals_conv_of_materialised_sum[True-dtype1]",
    "test_conv1d_triton.py::test_x_add_fp32_matches_reference_of_sum[b1t29c19w3-None-packed]",
    "test_conv1d_triton.py::test_x_add_fp32_matches_reference_of_sum[b2t21c24w4-bias-state-silu]",
    "test_kernels_bounds.py::test_deltaproduct_in_bounds[4-64-False-None]",
    "test_models_loss_triton.py::test_grad_in_forward_upstream_scale_is_not_rounded",
}


def _slow_id(item) -> str:
    return f"{item.path.name}::{item.name}"


def pytest_collection_modifyitems(config, items):
    """The slow tier: SLOW above, and the tests that launch training ranks (multirank) or install the wheel (install).
    GPU tests are skipped without CUDA. A SLOW entry whose file was collected but which names no test is an error
    (a renamed test would silently move to the fast tier)."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    seen, files = set(), {item.path.name for item in items}
    for item in items:
        if _slow_id(item) in SLOW or "multirank" in item.keywords or "install" in item.keywords:
            seen.add(_slow_id(item))
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    if all("::" not in arg for arg in config.args):  # whole files collected: each of their SLOW entries must exist
        stale = sorted(s for s in SLOW - seen if s.split("::")[0] in files)
        if stale:
            raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")


@pytest.fixture(scope="module")
def fast_interpreter():
    """The Triton interpreter checks every int32 op for overflow (slow in Python). Kernel test modules whose index
    math is bounded by the tensor sizes turn the check off: `pytestmark = pytest.mark.usefixtures("fast_interpreter")`."""
    if torch.cuda.is_available():
        yield
        return
    import dataclasses

    from triton.runtime import interpreter as interp
    old = interp.interpreter_builder.options
    interp.interpreter_builder.options = dataclasses.replace(old, sanitize_overflow=False)
    yield
    interp.interpreter_builder.options = old


@pytest.fixture
def autotuner_runs(monkeypatch):
    """The names of the kernels triton's Autotuner runs from here on (appended per call), with the kept launch
    configs (lm_kernels.autotune.launch) and the SSD's cached plans emptied first."""
    import lm_kernels.autotune as at
    import lm_kernels.ssd.launch as ln
    from triton.runtime.autotuner import Autotuner

    runs = []
    orig = Autotuner.run

    def counting(self, *a, **k):
        runs.append(self.base_fn.__name__)
        return orig(self, *a, **k)

    monkeypatch.setattr(Autotuner, "run", counting)
    monkeypatch.setattr(at, "_BEST", {})
    monkeypatch.setattr(ln, "_PLANS", {})
    return runs


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def spy_solve(monkeypatch):
    """spy_solve(module) -> a list that receives the keyword arguments of every later call of `module.solve` (the
    fixed-point solve a model module imported; the real solve still runs)."""
    def install(module):
        seen = []
        real = module.solve

        def spy(f, z0, **kw):
            seen.append(kw)
            return real(f, z0, **kw)

        monkeypatch.setattr(module, "solve", spy)
        return seen

    return install
