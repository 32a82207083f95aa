"""Fixtures of the runtime tests that build on the session's `tiny` model (tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from retention.policy.scoring.calibration import calibrate


@pytest.fixture(scope="module")
def tiny64(tiny):
    """tiny-random in float64: batched and single decodes agree to the last token there."""
    return copy.deepcopy(tiny.model).to(torch.float64)


@pytest.fixture(scope="module")
def stats_path(tiny, tmp_path_factory):
    """TriAttention statistics of `tiny`, calibrated on 300 seeded random tokens."""
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    return str(calibrate(tiny.model, ids).save(tmp_path_factory.mktemp("stats") / "tiny.safetensors"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """tiny-random saved as a model folder: the cross-engine bench and an external engine load
    folders, not code."""
    from retention.models import build_tiny_random

    folder = tmp_path_factory.mktemp("tiny")
    model, tok = build_tiny_random(0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
