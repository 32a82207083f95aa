"""The prompt axis in the report: every arm's prompt rule is shown, and a comparison that pairs arms
under different memory conventions (the prompt counted vs kept on top of b) says so."""

import pytest

from protocol import report
from protocol.render import terminal_summary
from protocol.runs import PEERS_CONVENTION, PROTOCOL_CONVENTION, prompt_convention, prompt_rule
from tests.protocol.test_report import make_run


def test_rules_and_conventions():
    assert prompt_rule({}) == "evict"
    assert prompt_rule({"protect_prompt_counted": True}) == "keep"
    assert prompt_rule({"protect_prompt_counted": False, "protect_prompt": True}) == "keep-on-top"
    assert prompt_convention("evict", "keep") == PROTOCOL_CONVENTION
    assert prompt_convention("keep-on-top", "keep-on-top") == PEERS_CONVENTION
    assert prompt_convention("keep-on-top", "evict").startswith("MIXED: treatment prompt on top")


@pytest.fixture(scope="module")
def rep(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    make_run(root, scorer="triattention", seed=1)
    make_run(root, scorer="random-pp", seed=2, shift=0.05, extra={"protect_prompt_counted": True})
    make_run(root, scorer="streaming", seed=3, extra={"protect_prompt": True})
    return report.build_report([root], baseline="triattention", boot=500, seed=1)


def test_every_arm_shows_its_rule(rep):
    rules = {a["scorer"]: a["prompt"] for a in rep.arms}
    assert rules == {"triattention": "evict", "random-pp": "keep", "streaming": "keep-on-top"}
    labels = {a["scorer"]: a["label"] for a in rep.arms}
    assert labels["random-pp"].endswith("+pp-in") and labels["streaming"].endswith("+pp")


def test_a_mixed_pair_is_said_to_be_mixed(rep):
    rows = {r["treatment"].split("+")[0]: r for r in rep.comparisons}
    assert rows["random-pp"]["prompt_convention"] == PROTOCOL_CONVENTION
    assert (rows["random-pp"]["t_prompt"], rows["random-pp"]["b_prompt"]) == ("keep", "evict")
    assert rows["streaming"]["prompt_convention"].startswith("MIXED")
    text = terminal_summary(rep)
    assert "prompt" in text.splitlines()[0] or any(" prompt " in line for line in text.splitlines()[:2])
    assert any(line.startswith("prompt ") and "MIXED" in line and "memory not matched" in line
               for line in text.splitlines())
