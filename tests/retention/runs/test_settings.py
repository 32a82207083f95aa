"""Run settings (`retention.runs.settings`): built and validated once, and written back as exactly the
configuration keys every path wrote before the type existed (so every configuration keeps its hash)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.plans import arm_config, load_plan
from protocol.prereg import ARMS
from retention.errors import RetentionError
from retention.models import model_layout
from retention.models.layouts import tokens_for_bytes
from retention.runs.arms import validate_arm
from retention.runs.settings import Budget, Output, RunSettings, Sampling, tokens_for_kib
from retention.runtime.sampling import DEFAULT_SAMPLER, LEGACY_SAMPLER

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "results").rglob("config.json"))
PLANS = sorted((ROOT / "results").rglob("plan*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_committed_configuration_gives_back_its_own_settings_keys(path):
    """What `reproduce` reads: the settings of a recorded configuration write its keys back, values
    and types (1 is not 1.0 in the hash) unchanged."""
    config = json.loads(path.read_text())["config"]
    written = RunSettings.from_config(config).config()
    assert {k: (v, type(v)) for k, v in written.items()} == {k: (config[k], type(config[k])) for k in written}


@pytest.mark.parametrize("path", PLANS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_committed_plan_arm_gives_its_settings(path):
    """Every arm of every cell of a committed plan builds its settings as the confirm runner does."""
    plan, h = load_plan(path)
    for cell in plan["cells"]:
        for arm in ARMS:
            cfg = arm_config(plan, h, cell, arm)
            settings = RunSettings.from_plan(cfg, Output(Path("unused")))
            assert settings.problems.split == "confirm" and settings.model == cfg["model"]
            assert isinstance(settings.sampling.temperature, float) and isinstance(settings.sampling.top_p, float)


def test_options_and_config_build_the_same_settings():
    options = RunSettings.from_options("tiny-random", limit=2, samples=3, max_new_tokens=16, temperature=0.0,
                                       seed=7, ignore_eos=True)
    assert RunSettings.from_config(options.config()).config() == options.config()
    assert options.config() == {
        "model": "tiny-random", "dtype": "float32", "device": "cpu", "split": "dev", "data": None, "limit": 2,
        "samples": 3, "seed": 7, "fidelity": False, "max_new_tokens": 16, "temperature": 0.0, "top_p": 0.95,
        "ignore_eos": True, "sampler": DEFAULT_SAMPLER}


def test_another_engine_leaves_the_sampler_out_and_the_plan_names_its_engine():
    assert "sampler" not in RunSettings.from_options("tiny-random", engine="vllm").config()
    assert "engine" not in RunSettings.from_options("tiny-random", engine="vllm").config()  # the engine adds its own
    assert RunSettings.from_config({"model": "tiny-random", "engine": "hf"}).config()["engine"] == "hf"


def test_a_plan_whole_number_temperature_runs_as_a_float():
    cfg = {"model": "tiny-random", "split": "confirm", "temperature": 1, "top_p": 1, "max_new_tokens": 8,
           "samples": 1, "seed": 0}
    sampling = RunSettings.from_plan(cfg, Output()).sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 1.0)
    assert isinstance(sampling.temperature, float) and isinstance(sampling.top_p, float)
    assert isinstance(RunSettings.from_config(cfg).sampling.temperature, int)  # as recorded


@pytest.mark.parametrize("options, needle", [
    ({"split": "confirm"}, "reachable only through a pre-registered plan"),
    ({"temperature": float("nan")}, "--temperature must be a finite number"),
    ({"top_p": 0.0}, "--top-p must be > 0"),
    ({"samples": 0}, "--samples must be >= 1"),
    ({"max_new_tokens": 1 << 21}, "--max-new-tokens must be <="),
    ({"engine": "tgi"}, "--engine must be one of hf, vllm"),
    ({"dataset": "aime24", "data_path": "x.jsonl"}, "--data gives a MATH-500 copy"),
    ({"dataset": "aime24", "limit": 31}, "31"),
    ({"engine": "vllm", "trace": True}, "--trace records this project's cache and needs --engine hf"),
    ({"isa_portable": True, "dtype": "bfloat16"}, "--isa-portable needs --dtype float32"),
])
def test_each_bad_setting_is_one_line(options, needle):
    with pytest.raises(RetentionError) as err:
        RunSettings.from_options("tiny-random", **options)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_null_sampler_in_a_configuration_is_refused():
    with pytest.raises(RetentionError, match="--sampler must be one of"):
        RunSettings.from_config({"model": "tiny-random", "sampler": None})
    with pytest.raises(RetentionError, match="math500 is written by leaving it out"):
        RunSettings.from_config({"model": "tiny-random", "dataset": "math500"})


def test_the_budget_in_kib_is_converted_once_through_the_layout():
    settings = RunSettings.from_options("tiny-random")
    budget = Budget.from_options(settings, budget_kib=64.0)
    assert budget.tokens == tokens_for_bytes(model_layout("tiny-random", "float32"), 64 * 1024)
    assert budget.tokens == tokens_for_kib("tiny-random", "float32", None, 64.0)
    assert budget.config()["budget_kib"] == 64.0 and budget.config()["budget"] == budget.tokens
    with pytest.raises(RetentionError, match="not both"):
        Budget.from_options(settings, budget=8, budget_kib=64.0)
    with pytest.raises(RetentionError, match="--protect-prompt keeps the prompt on top"):
        Budget.from_options(settings, budget=8, protect_prompt=True, prompt_rule="keep")


def test_the_prompt_rule_is_recorded_only_where_set():
    settings = RunSettings.from_options("tiny-random")
    assert "protect_prompt_counted" not in Budget.from_options(settings, budget=8).config()
    assert Budget.from_options(settings, budget=8, prompt_rule="keep").config()["protect_prompt_counted"] is True
    assert Budget.from_options(settings, budget=8, prompt_rule="keep-on-top").config()["protect_prompt"] is True


def test_an_arm_built_on_settings_is_the_arm_of_its_whole_configuration():
    """`validate_arm(arm, settings=...)` and `validate_arm(whole configuration)` are one arm."""
    settings = RunSettings.from_options("tiny-random", limit=1, max_new_tokens=8)
    arm = dict(Budget(tokens=32).config(), scorer="streaming", scorer_params={})
    assert validate_arm(arm, settings=settings).hash == validate_arm(dict(settings.config(), **arm)).hash


def test_sampling_hands_the_engines_their_dict():
    s = Sampling(64, 0.0, 1.0, True, 3, None)
    assert s.engine_args() == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
    assert s.drawn_with == LEGACY_SAMPLER  # absent from the configuration: the legacy sampler


@pytest.mark.parametrize("values, needle", [
    ({"tokens": 0}, "--budget must be >= 1"),
    ({"kib": 0.0}, "--budget-bytes must be > 0"),
    ({"interval": 1 << 25}, "--interval must be <="),
    ({"sink": -1}, "--sink must be >= 0"),
    ({"recent": 1.5}, "--recent must be a finite integer"),
    ({"accounting": "median"}, "--accounting must be mean, prefill or peak"),
])
def test_a_budget_checks_each_value_when_built(values, needle):
    """However it is built (options, a configuration, the API), a budget is checked once, there."""
    with pytest.raises(RetentionError, match=needle.replace("(", r"\(")):
        Budget(**values)
