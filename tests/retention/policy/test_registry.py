"""The one registry of the five families (`retention.policy.registry`): a name resolved once into a
`MechanismSpec` that carries its class from then on."""

from __future__ import annotations

import pickle

import pytest

import retention.scorers
from retention.errors import RetentionError
from retention.policy.registry import ALL_FAMILIES, MechanismSpec, family, mechanism_class
from retention.policy.scoring.base import Scorer
from retention.runs.arms import validate_arm


def test_one_registry_holds_all_five_families():
    assert list(ALL_FAMILIES) == ["scorer", "cadence", "routing", "state", "decoding"]
    for name, fam in ALL_FAMILIES.items():
        assert family(name) is fam and mechanism_class(name, fam.default) is fam.builtins[fam.default]
        assert all(issubclass(cls, fam.base) for cls in fam.builtins.values())
    with pytest.raises(RetentionError, match="unknown scorer 'nope'; known scorers: full, random"):
        mechanism_class("scorer", "nope")
    with pytest.raises(RetentionError, match="unknown state 'zip'; known: full, merge, quant"):
        mechanism_class("state", "zip")


def test_a_spec_carries_its_class_and_survives_a_trip_to_another_process():
    spec = validate_arm({"model": "tiny-random", "scorer": "snapkv", "budget": 24,
                         "routing": {"name": "pyramidkv", "params": {"beta": 4}}})
    assert spec.scorer.cls is mechanism_class("scorer", "snapkv")
    assert spec.routing.cls is mechanism_class("routing", "pyramidkv") and spec.routing.kwargs == {"beta": 4.0}
    back = pickle.loads(pickle.dumps(spec))  # a Ray task: the class is resolved again by name there
    assert back == spec and back.hash == spec.hash and back.routing.cls is spec.routing.cls
    assert MechanismSpec.of("state", "quant", {"bits": 8}).build().bits == 8


def test_the_plugin_face_is_a_re_export():
    assert retention.scorers.Scorer is Scorer
    assert not hasattr(retention.scorers, "get_scorer_class")  # no second registry
