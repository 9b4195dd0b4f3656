"""Which tests are ``slow`` and which are ``release_sensitive`` (applied by tests/conftest.py).

``slow`` (``make test-fast`` = ``pytest -m "not slow"`` leaves them out; ``make test`` and CI run
them): every test that uses a Megatron-LM checkout (the ``megatron_lm_checkout`` fixture, directly
or through ``patched_megatron_lm``: it launches Megatron-LM's ``pretrain_gpt.py``, its dry run or
the patch script, 5-55 s each), marked automatically, so new test files need no entry; and the
tests listed in ``SLOW`` below (over 5 s on 2 cores, setup included).

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
    "tests/test_megatron_lm_train.py::test_resume_in_the_same_layout_is_bit_exact[tp]":
        "stock Megatron-LM's own resume; METP's sharded state dict is the [metp] id",
    "tests/test_hf_megatron_lm_families.py::test_pretrain_gpt_prints_transformers_loss_at_"
    "iteration_1[qwen3]":
        "[qwen3_yarn] passes the same qwen3 flags (--qk-layernorm, --kv-channels) plus YaRN",
}

#: node id -> its time on 2 cores (s, setup included), for the tests over 5 s that use no
#: Megatron-LM checkout
SLOW = {
}


def matches(nodeid: str, entries) -> bool:
    """Whether ``nodeid`` is one of ``entries`` or a parametrization of one (an entry may end
    inside a ``[param id]``, matching the ids that start with it)."""
    for e in entries:
        if nodeid == e or (nodeid.startswith(e) and (e.endswith("[") or "[" in e
                                                      or nodeid[len(e)] == "[")):
            return True
    return False


def stale(items) -> list:
    """The entries of both tables whose file was collected but that match no collected test."""
    ids = [i.nodeid for i in items]
    files = {n.split("::", 1)[0] for n in ids}
    return sorted(e for table in (RELEASE_INDEPENDENT, SLOW) for e in table
                  if e.split("::", 1)[0] in files and not any(matches(n, (e,)) for n in ids))
