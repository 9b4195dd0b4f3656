"""Which tests are ``slow`` and which are ``release_sensitive`` (applied by tests/conftest.py).

``slow`` (``make test-fast`` = ``pytest -m "not slow"`` leaves them out; ``make test`` and CI run
them): every test that uses a Megatron-LM checkout (the ``megatron_lm_checkout`` fixture, directly
or through ``patched_megatron_lm``: it launches Megatron-LM's ``pretrain_gpt.py``, its dry run or
the patch script, 5-55 s each), marked automatically, so new test files need no entry; the tests
listed in ``SLOW`` below (over 5 s on 2 cores), and those using a fixture of ``SLOW_FIXTURES``
(a module-scoped set-up over 5 s). At the end of a run pytest lists the tests over 5 s (set-up +
call) that are not marked yet (tests/conftest.py).

``release_sensitive``: the Megatron-LM tests (``megatron_lm`` marker) that the core_v0.19.0 leg
(``make test-019``) runs again: those whose outcome depends on what differs between Megatron-LM
releases (the patch, the hooks into Megatron-LM's code, its argument parser and saved args, its
checkpoint format, its dataset API, the HF import's arguments, the dry run through the release's
own model build). Every Megatron-LM test is release-sensitive unless ``RELEASE_INDEPENDENT``
names it with the reason: a test that checks METP's own arithmetic or the planner through a path
that a release-sensitive test already crosses on both releases. New Megatron-LM tests therefore
run on both legs until someone lists them here.

Entries are node ids (``path::name``, optionally with the ``[param id]``); an entry matches the
test and all its parametrizations. An entry whose file was collected but that matches no test
fails the collection (a renamed test must not lose its mark silently).
"""

#: node id -> why the core_v0.19.0 leg need not run it again (the .venv leg runs it)
RELEASE_INDEPENDENT = {
    "tests/test_mla_plan.py::test_deepseek_v2_lite_config_dry_run_plan_and_measure_agree":
        "planner vs dry-run bytes of METP's MLA (METP's own accounting); DeepSeek-V2-Lite's MLA "
        "without a query latent is refused with METP on core_v0.19.0 (its query norm is fused "
        "into linear_q_proj there, Transformer Engine only: megatron/mla.py), by name",
    "tests/test_moe_ep_wide_megatron_lm.py::test_stock_ep_twin_continues_from_the_wide_ep_"
    "checkpoint":
        "a stock twin's load of the wide-EP checkpoint (stock's own keys and shapes, checked on "
        "both releases by test_ep_2p_and_its_stock_twin_print_the_same_losses_and_checkpoints); "
        "the load across layouts is release-checked for EP = p by tests/test_moe_megatron_lm.py",
    "tests/test_scripts.py::test_dry_run_end_to_end[tiny-cpu-tp2.sh-":
        "stock TP through the same dry-run path as the METP id (which runs on both releases)",
    "tests/test_scripts.py::test_dry_run_plan_and_measure_agree":
        "planner vs measure byte counts (METP's own); the dry-run path is release-checked by "
        "test_dry_run_end_to_end[tiny-cpu-metp2.sh]",
    "tests/test_scripts.py::test_cpu_kernel_accounting_is_what_breaks_agreement":
        "the dry run's CPU-kernel accounting (METP's own)",
    "tests/test_scripts.py::test_recompute_and_offload_agree_through_megatron_lm":
        "planner vs dry run bytes with recompute/offload (METP's own accounting)",
    "tests/test_packed_megatron.py::test_dry_run_of_the_packed_config":
        "the packing flags through the release are run by test_packed_documents_train_with_the_"
        "same_losses_as_stock_tp on both releases",
    "tests/test_plan_cp.py::test_dry_run_plan_and_measure_agree_on_metp_cp":
        "planner vs measure (METP's own); CP through the release is trained by test_metp_times_"
        "cp_trains_with_the_stock_tp_twins_losses on both releases",
    "tests/test_families_plan.py::test_qwen3_job_dry_run_plan_and_measure_agree":
        "planner vs measure; the qwen3 flags through the release: the HF families test "
        "[qwen3_yarn] on both releases",
    "tests/test_rope_model.py::test_pretrain_gpt_dry_run_refuses_fp32_recipe_past_2_24[stock]":
        "the same validate_args guard as the [metp-fp32-recipe] id",
    "tests/test_megatron_lm_train.py::test_overlapped_grad_reduce_and_param_gather_train_as_"
    "without[metp-modules]":
        "the release's DDP hook wiring (wire_ddp in each release's patch) is checked on both "
        "releases by the [streaming-layer] id; which METP modules the cover marks is METP's own",
    "tests/test_megatron_lm_train.py::test_resume_in_the_same_layout_is_bit_exact[tp]":
        "stock Megatron-LM's own resume; METP's sharded state dict is the [metp] id",
    "tests/test_hf_megatron_lm_families.py::test_pretrain_gpt_prints_transformers_loss_at_"
    "iteration_1[qwen3]":
        "[qwen3_yarn] passes the same qwen3 flags (--qk-layernorm, --kv-channels) plus YaRN",
    "tests/test_hf_megatron_lm_moe_families.py::test_pretrain_gpt_loads_an_import_and_prints_"
    "transformers_loss[qwen2_moe]":
        "its flags through the release: the gated shared expert by tests/test_moe_megatron_lm.py"
        "::test_shared_experts_train_as_the_stock_twin_and_cross_checkpoints, --add-qkv-bias by "
        "the HF families test [qwen2], the MoE import by [glm4_moe], all on both releases",
}

#: node id -> its time on 2 cores (s; the CI legs' --durations, the largest seen), for the tests
#: over 5 s that use no Megatron-LM checkout
SLOW = {
    "tests/test_mla_megatron.py::test_stock_resumes_a_metp_mla_checkpoint": 7.7,
    "tests/test_moe_ep_wide.py::test_three_adam_steps_distributed_optimizer_ep4_match_single_"
    "rank_stock": 8.8,
    "tests/test_moe_ep_wide.py::test_negative_control_metp_shards_without_their_replica_sum": 5.8,
    "tests/test_moe_ep_wide.py::test_checkpoint_in_stocks_expert_layout_resumes_in_other_"
    "layouts": 12.0,
    "tests/test_moe_ep_wide_plan.py::test_measure_of_ep4_over_metp2_x_cp2_matches_the_plan": 15.2,
    "tests/test_keep_attention.py::test_kept_attention_in_compositions": 7.3,
    "tests/test_leak_guard.py::test_a_test_that_leaves_a_variable_set_errors_and_the_next_one_"
    "passes": 8.1,
    "tests/test_measure_rope.py::test_measure_forms_only_this_ranks_rope_angles_as_training_"
    "does": 60.0,
    "tests/test_fast_dry.py::test_sampled_tile_passes_give_the_full_loops_bytes_and_traffic": 15.3,
    "tests/test_fast_dry.py::test_sampled_moe_token_tiles_give_the_full_loops_bytes_and_"
    "traffic": 12.9,
    "tests/test_fast_dry.py::test_layer_extrapolation_matches_the_full_depth_and_a_wrong_rule_is_"
    "caught": 15.0,
    "tests/test_fast_dry.py::test_sampled_ring_steps_give_the_full_rings_bytes_and_traffic": 11.5,
    "tests/test_fast_dry.py::test_a_wrong_ring_sampling_rule_is_caught": 9.9,
    "tests/test_fast_dry.py::test_sampled_ring_in_the_measured_twin_gives_the_full_measurement":
        5.8,
    "tests/test_checkpoint_faults.py::test_a_stalled_rank_fails_the_save_within_the_bound_and_"
    "publishes_nothing": 9.8,
    "tests/test_cuda_accounting.py::test_megatron_fused_activations_are_chunked_and_equal": 16.7,
    "tests/test_fewer_launches.py::test_gpu_check_dry_runs_its_code_paths_on_cpu": 8.5,
    "tests/test_fewer_launches.py::test_issue_21_bounds_catch_per_step_merges_and_forced_tiles":
        12.2,
    "tests/test_megatron_cp.py::test_checkpoint_saved_under_cp_resumes_exactly_and_in_metp_alone":
        7.4,
    "tests/test_offload_partial.py::test_partial_offload_through_the_streaming_layer": 13.3,
    "tests/test_offload_partial.py::test_partial_offload_trains_as_no_offload_and_sends_only_its_"
    "layers": 25.1,
    "tests/test_offload_partial.py::test_partial_offload_with_pipeline_stages_counts_layers_per_"
    "stage": 7.4,
    "tests/test_plan.py::test_cli_plan_writes_charts_and_refuses_bad_sizes": 8.1,
    "tests/test_plan_cp.py::test_cli_reach": 5.4,
    "tests/test_recompute.py::test_full_recompute_is_exact_in_compositions": 10.5,
    "tests/test_recompute_output.py::test_freed_outputs_leave_training_bit_identical": 6.5,
    "tests/test_soak.py::test_forty_metp_steps_keep_memory_and_handles_flat": 12.8,
    "tests/test_soak.py::test_negative_control_a_retained_ring_buffer_is_caught": 10.2,
    "tests/test_tiles_megatron.py::test_tiled_training_equals_untiled": 32.6,
    "tests/test_tiles_megatron.py::test_tiled_training_equals_untiled_with_tp_and_pp": 10.6,
    "tests/test_tiles_megatron.py::test_packed_documents_in_tiles_train_as_untiled": 5.9,
    "tests/test_vocab_loss_tiles_megatron.py::test_tiled_loss_training_equals_untiled": 9.6,
    # measured on this machine under load (test_megatron_cp's checkpoint test above: 9.0 s there)
    "tests/test_offload.py::test_offload_is_exact_across_layouts[3-base0]": 12.2,
    "tests/test_offload.py::test_offload_is_exact_across_layouts[4-base1]": 6.6,
    "tests/test_offload.py::test_offload_is_exact_across_layouts[4-base2]": 6.2,
    "tests/test_checkpoint.py::test_vocab_parallel_checkpoint_resumes_exactly_and_as_stock_tp":
        11.5,
    "tests/test_packed_megatron.py::test_balanced_layout_matches_stock": 7.0,
    "tests/test_packed_megatron.py::test_packed_compositions_match_stock": 6.4,
    "tests/test_megatron_cp.py::test_packed_documents_train_as_single_rank_stock": 6.2,
    "tests/test_megatron_gpt.py::test_gpt_metp_matches_stock_tp_and_single_rank[4]": 6.0,
    "tests/test_moe_plan.py::test_plan_counts_stock_dispatcher_state_under_full_recompute": 11.4,
    "tests/test_keep_plan.py::test_measure_builds_kept_attention_as_the_plan_prices_it": 14.8,
    "tests/test_keep_plan.py::test_layer_extrapolation_of_a_partial_keep_matches_the_full_"
    "depth": 31.4,
    "tests/test_moe_routers.py::test_expert_bias_two_adam_steps_match_single_rank_stock[metp2]":
        9.3,
    "tests/test_moe_routers.py::test_expert_bias_two_adam_steps_match_single_rank_stock[metp3]":
        8.9,
}

#: ``path::fixture`` -> its set-up time (s, as above): the tests of that file that use the
#: (module-scoped) fixture are slow, all of them (marking only the first would move the cost)
SLOW_FIXTURES = {
    "tests/test_hf_moe_families.py::models": 11.5,
    "tests/test_moe_plan.py::measured": 6.5,
    "tests/test_moe_shared_plan.py::measured": 6.0,
    "tests/test_moe_stock_recompute_plan.py::measured": 9.1,
    "tests/test_plan.py::measured": 40.4,
    "tests/test_recompute.py::metp2": 19.5,
    "tests/test_hf.py::models": 9.3,
    "tests/test_hf_versions.py::tiny": 5.4,
    "tests/test_families_plan.py::measured": 5.5,
    "tests/test_plan_cp.py::cp_measured": 5.1,
    "tests/test_offload.py::metp2_offload": 8.6,
    "tests/test_checkpoint.py::saved": 6.0,
    "tests/test_doc_figures.py::tool_figures": 20.0,  # 40 s before the search kept its plans
    "tests/test_keep_attention.py::metp2": 13.7,
    "tests/test_mla_plan.py::measured": 10.4,  # 3-5 s when the machine is idle
}


def matches(nodeid: str, entries) -> bool:
    """Whether ``nodeid`` is one of ``entries`` or a parametrization of one (an entry may end
    inside a ``[param id]``, matching the ids that start with it)."""
    for e in entries:
        if nodeid == e or (nodeid.startswith(e) and (e.endswith("[") or "[" in e
                                                      or nodeid[len(e)] == "[")):
            return True
    return False


def uses_slow_fixture(item) -> bool:
    """Whether ``item`` uses one of its file's ``SLOW_FIXTURES``."""
    path = item.nodeid.split("::", 1)[0]
    return any(f"{path}::{f}" in SLOW_FIXTURES for f in getattr(item, "fixturenames", ()))


def stale(items) -> list:
    """The entries of the tables whose file was collected but that match no collected test."""
    ids = [i.nodeid for i in items]
    files = {n.split("::", 1)[0] for n in ids}
    used = {f"{i.nodeid.split('::', 1)[0]}::{f}" for i in items
            for f in getattr(i, "fixturenames", ())}
    return sorted([e for table in (RELEASE_INDEPENDENT, SLOW) for e in table
                   if e.split("::", 1)[0] in files and not any(matches(n, (e,)) for n in ids)] +
                  [e for e in SLOW_FIXTURES if e.split("::", 1)[0] in files and e not in used])
