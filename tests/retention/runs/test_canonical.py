"""One cell per hypothesis, whatever its spelling (issue 46): negative zero, a float one rounding step
away, an integral float for an integer, a mechanism at its trivial setting, a copied or linked model
folder, one plugin under two names, and a helper imported from outside the plugin's folder."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from protocol.numbers import canonical_float
from protocol.plans import cell_identity, cell_key
from retention.errors import RetentionError
from retention.models.content import content_sha256
from retention.plugins import class_identity, load_plugin
from retention.runs.arms import validate_arm
from retention.runs.identity import model_identity
from retention.policy.scoring.base import Scorer


def _hash(stats, scorer="alpha", params=None, **families):
    cfg = {"model": "tiny-random", "budget": 64, "scorer": scorer, "split": "dev",
           "scorer_params": {"stats": stats, **(params or {})}, **families}
    return validate_arm(cfg).hash


def test_negative_zero_and_near_equal_floats_are_one_arm(stats_path):
    assert _hash(stats_path, params={"radius": -0.0}) == _hash(stats_path, params={"radius": 0.0})
    assert _hash(stats_path, params={"lam": 0.1 * 7}) == _hash(stats_path, params={"lam": 0.7})
    assert 0.1 * 7 != 0.7  # the spelling the rule exists for
    merge = lambda t: {"name": "merge", "params": {"threshold": t}}  # noqa: E731
    assert _hash(stats_path, state=merge(-0.0)) == _hash(stats_path, state=merge(0.0))
    assert _hash(stats_path, temperature=0.6000000000000001) == _hash(stats_path, temperature=0.6)
    assert _hash(stats_path, params={"lam": 0.5}) != _hash(stats_path, params={"lam": 0.7})


def _spec(stats, scorer, params=None, **families):
    return validate_arm({"model": "tiny-random", "budget": 64, "scorer": scorer, "split": "dev",
                         "scorer_params": {"stats": stats, **(params or {})}, **families})


@pytest.mark.parametrize("scorer", ["triattention", "alpha"])
def test_the_kept_set_structure_is_one_arm_however_it_is_written(stats_path, scorer):
    """Routing is a family only (issue 47): a configuration that writes the structure as the scorer's
    `routing` (every one written before), one that names the routing family, and one that writes
    both or neither resolve to the same spec and hash, and the configuration is written as before
    (`scorer_params.routing`, no `routing` key) so that its hash stands."""
    for structure in ("shared", "per-layer"):
        spellings = [_spec(stats_path, scorer, {"routing": structure}), _spec(stats_path, scorer, routing=structure),
                     _spec(stats_path, scorer, {"routing": structure}, routing=structure)]
        if structure == "shared":  # the scorers' default structure: what `native` (or no key) runs
            spellings += [_spec(stats_path, scorer), _spec(stats_path, scorer, routing="native"),
                          _spec(stats_path, scorer, {"routing": "shared"}, routing="native")]
        first = spellings[0]
        for spec in spellings:
            assert spec == first and spec.hash == first.hash and spec.routing.cls is first.routing.cls
        assert first.routing.name == ("native" if structure == "shared" else "per-layer")
        assert first.config["scorer_params"]["routing"] == structure and "routing" not in first.config
        assert "routing" not in first.scorer.kwargs and first.build_scorer().per_layer == (structure == "per-layer")
        assert first.policy().scorer.per_layer == (structure == "per-layer")
    assert _spec(stats_path, scorer).hash != _spec(stats_path, scorer, routing="per-layer").hash
    with pytest.raises(RetentionError, match="disagree"):
        _spec(stats_path, scorer, {"routing": "shared"}, routing="per-layer")
    with pytest.raises(RetentionError, match="--routing must be one of shared, per-layer"):
        _spec(stats_path, scorer, {"routing": "sideways"})


def test_a_float_beyond_the_compared_precision_is_refused(stats_path):
    with pytest.raises(RetentionError, match=r"alpha.lam: 0.123456789012345 has more than 12 significant digits"):
        _hash(stats_path, params={"lam": 0.123456789012345})
    with pytest.raises(ValueError):
        canonical_float(1.0000000000001)
    assert canonical_float(-0.0) == 0.0 and str(canonical_float(-0.0)) == "0.0"


def test_integral_float_for_an_integer_parameter_is_converted_and_a_fraction_refused(stats_path):
    quant = lambda **p: {"name": "quant", "params": p}  # noqa: E731
    assert _hash(stats_path, state=quant(bits=8.0, group=16.0)) == _hash(stats_path, state=quant(bits=8, group=16))
    spec = validate_arm({"model": "tiny-random", "budget": 64, "scorer": "alpha", "split": "dev",
                         "scorer_params": {"stats": stats_path}, "state": quant(bits=4.0)})
    assert spec.config["state"]["params"]["bits"] == 4 and isinstance(spec.policy().state.bits, int)
    with pytest.raises(RetentionError, match=r"quant.bits is an integer parameter, got 8.5"):
        _hash(stats_path, state=quant(bits=8.5))


def test_a_trivial_setting_is_the_mechanism_it_equals(stats_path):
    per_layer = _hash(stats_path, "triattention", routing="per-layer")
    assert _hash(stats_path, "triattention", routing={"name": "pyramidkv", "params": {"beta": 1}}) == per_layer
    assert _hash(stats_path, "triattention", routing={"name": "adakv", "params": {"alpha": 1.0}}) == per_layer
    assert _hash(stats_path, "triattention", routing={"name": "pyramidkv", "params": {"beta": 2}}) != per_layer
    full = _hash(stats_path)
    for threshold in (1.01, 1.005):  # above any cosine: nothing merges, whatever the spelling
        assert _hash(stats_path, state={"name": "merge", "params": {"threshold": threshold}}) == full
    assert _hash(stats_path, cadence={"name": "newline", "params": {"max_wait": 0}}) == full
    assert _hash(stats_path, decoding={"name": "loop-guard", "params": {"max_repeats": 5000}}) == full
    assert _hash(stats_path, decoding={"name": "loop-guard", "params": {"max_repeats": 3}}) != full
    # What runs is the routing it equals (on triattention: one kept set per layer, no allocation); its
    # refusals stand (pyramidkv needs a top-k scorer).
    spec = validate_arm({"model": "tiny-random", "budget": 64, "scorer": "triattention", "split": "dev",
                         "scorer_params": {"stats": stats_path}, "routing": {"name": "pyramidkv", "params": {"beta": 1}}})
    policy = spec.policy()
    assert type(policy.routing).__name__ == "PerLayer" and policy.scorer.per_layer
    with pytest.raises(RetentionError, match="pyramidkv"):
        _hash(stats_path, routing={"name": "pyramidkv", "params": {"beta": 1}})


def test_a_copied_or_linked_model_folder_is_one_model(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    link = tmp_path / "link"
    os.symlink(tiny_folder, link)
    idents = [model_identity(str(p)) for p in (tiny_folder, copy, link)]
    assert len({i.content for i in idents}) == 1 and idents[0].content is not None
    assert idents[0].name != idents[1].name  # loaded from where it is, identified by what it is
    # Cached by (path, size, mtime): a second digest reads the cache, an edited config is another model.
    assert (tmp_path / "cache" / "content-hashes.json").is_file()
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, rope_theta=12345.0)))
    assert content_sha256(copy) != idents[0].content
    plan = {"split_manifest_sha256": "0" * 64, "treatment": {"scorer": "alpha"}, "baseline": {"scorer": "full"},
            "model_contents": {str(tiny_folder): idents[0].content, str(copy): idents[0].content}}
    a, b = ({"id": "x", "model": str(m), "budget": 64} for m in (tiny_folder, copy))
    assert cell_key(cell_identity(plan, a)) == cell_key(cell_identity(plan, b))


PLUGIN = '''
from retention.scorers import Scorer
import {helper}


class Norm(Scorer):
    name = "norm"
    def score(self, keys, *args, **kwargs):
        return keys.norm(dim=-1) * {helper}.SCALE
'''


def test_one_plugin_under_two_names_is_one_cell_and_outside_helpers_are_hashed(tmp_path, monkeypatch):
    pkg, elsewhere = tmp_path / "plug", tmp_path / "elsewhere"
    pkg.mkdir()
    elsewhere.mkdir()
    (pkg / "normplug46.py").write_text(PLUGIN.format(helper="helper46"))
    (elsewhere / "helper46.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.syspath_prepend(str(pkg))
    by_module = load_plugin("normplug46:Norm", Scorer)
    by_file = load_plugin(f"{pkg / 'normplug46.py'}:Norm", Scorer)
    assert by_module is not by_file  # two imports of one file
    a, b = class_identity(by_module, "normplug46:Norm"), class_identity(by_file, f"{pkg}/normplug46.py:Norm")
    assert a["spec"] != b["spec"] and a["code_sha256"] == b["code_sha256"]
    helper = str((elsewhere / "helper46.py").resolve())
    assert helper in a["sources_sha256"]  # imported from sys.path, outside the plugin's folder: identified
    plan = {"split_manifest_sha256": "0" * 64, "baseline": {"scorer": "full"}}
    cell = {"id": "x", "model": "tiny-random", "budget": 64}
    keys = [cell_key(cell_identity(dict(plan, treatment={"scorer": ident["spec"], "scorer_plugin": ident}), cell))
            for ident in (a, b)]
    assert keys[0] == keys[1]
    (elsewhere / "helper46.py").write_text("SCALE = 2.0\n")  # the helper changes what the plugin computes
    assert class_identity(by_module, "normplug46:Norm")["code_sha256"] != a["code_sha256"]
    for name in ("normplug46", "helper46"):
        sys.modules.pop(name, None)
