"""An arm is one typed spec: `ArmSpec`, the five mechanisms plus the resolved run configuration.

`retention.runs.arms.validate_arm` is the one place that builds it (from CLI options, a plan's arm
JSON, the notebook API or the contract kit): every mechanism resolved once to its canonical
`MechanismSpec` (`retention.policy.registry`: its name, its class, every parameter with its resolved
value, a plugin's identity), validated once and hashed once.
What runs is built from the spec alone (`ArmSpec.policy()`), so what a plan registers, what `run`
runs and what `confirm` checks are the same object.

The configuration (`config`, the dict written to `config.json` and hashed) names a non-default
mechanism of the cadence, routing, state and decoding families under the family's key as
`{"name": ..., "params": {...}}` (plus `"plugin"`: its identity, for a plugin); a family at its
default (`fixed`, `native`, `full`, `none`) is absent, so every configuration written before the
families existed keeps its hash.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from protocol.io import canonical_json, config_hash  # config_hash: re-exported for the runs
from retention.policy.cadence.base import Cadence
from retention.policy.composite import RetentionPolicy
from retention.policy.guard import GuardedPolicy
from retention.policy.registry import FAMILIES, MechanismSpec  # MechanismSpec: re-exported for the runs

NON_SCORING = tuple(FAMILIES)  # cadence, routing, state, decoding


@dataclass(frozen=True)
class ArmSpec:
    """One arm: the scorer (`scorer.params` are its constructor arguments, the statistics by path),
    the cadence built at the arm's budget, the other three mechanisms, and the configuration."""

    scorer: MechanismSpec
    cadence: Cadence
    cadence_spec: MechanismSpec
    routing: MechanismSpec
    state: MechanismSpec
    decoding: MechanismSpec
    config_json: str

    @property
    def name(self) -> str:
        """The scorer's name as given (built-in name, entry point or spec)."""
        return self.scorer.name

    @property
    def config(self) -> dict:
        """The resolved run configuration (a fresh copy: the spec itself never changes)."""
        return json.loads(self.config_json)

    @property
    def scorer_params(self) -> dict:
        return self.scorer.kwargs

    @property
    def mechanisms(self) -> dict[str, MechanismSpec]:
        return {"scorer": self.scorer, "cadence": self.cadence_spec, "routing": self.routing, "state": self.state,
                "decoding": self.decoding}

    def non_default(self) -> list[str]:
        """The families this arm changes from today's behaviour (scoring counts when not `full`)."""
        return [f for f, m in self.mechanisms.items() if f != "scorer" and not m.is_default]

    def build_scorer(self):
        """A fresh scorer as this arm runs it: built from its spec, in the kept-set structure its
        routing chooses (`Routing.structure_for`)."""
        scorer = self.scorer.build()
        structure = self.routing.cls.structure_for(scorer)
        return scorer if structure is None else scorer.structured(structure)

    def policy(self) -> RetentionPolicy:
        """Fresh mechanism instances for one run (per-run state never leaks between runs); an arm with
        a plugin runs under `GuardedPolicy`, which refuses it in one line at its first compaction when
        its scores, kept indices, bytes or logits break the contract."""
        args = (self.scorer.build(), dataclasses.replace(self.cadence), self.routing.build(), self.state.build(),
                self.decoding.build(), self.config.get("budget_kib") if self.cadence.evicts else None)
        plugins = self.plugins()
        if plugins:  # a plugin's outputs are checked at its first compactions (`retention.policy.guard`)
            return GuardedPolicy(*args, plugins=tuple(plugins))
        return RetentionPolicy(*args)

    @property
    def hash(self) -> str:
        """The configuration hash (run ids, resume, pairing)."""
        return config_hash(self.config)

    def plugins(self) -> list[str]:
        """`family:name` of every mechanism of this arm that comes from outside the package."""
        return [f"{m.family}:{m.name}" for m in self.mechanisms.values() if m.plugin is not None]

    def with_config(self, **extra) -> ArmSpec:
        """The same arm with keys added to its configuration (the loaded model's id and revision)."""
        return dataclasses.replace(self, config_json=canonical_json(dict(self.config, **extra)))
