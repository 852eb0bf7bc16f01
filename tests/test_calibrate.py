"""The runtime-cost cache (pipeline/calibrate.py) is keyed by what its figures depend on."""
from __future__ import annotations

import torch

from pipeline.calibrate import FORMAT, _key, cached_costs


def test_the_cache_key_names_the_optimizer_and_the_format() -> None:
    """``update_*`` time the run's optimizer: an AdamW run must not read SGD's figures (the key
    left the optimizer out until 2026-11-26), and a new measurement format misses old entries."""
    cpu = torch.device("cpu")
    sgd, fields = _key(cpu, "gloo", 2, "sgd")
    assert fields["optimizer"] == "sgd" and fields["format"] == FORMAT
    assert _key(cpu, "gloo", 2, "adamw")[0] != sgd
    assert _key(cpu, "gloo", 2, "sgd")[0] == sgd
    assert _key(cpu, "gloo", 4, "sgd")[0] != sgd


def test_nothing_cached_gives_the_assumed_costs(tmp_path) -> None:
    assert cached_costs("cpu", "gloo", 2, "adamw", cache_dir=tmp_path).source == "assumed"
