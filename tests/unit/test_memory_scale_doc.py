"""docs/memory-tier.md's scale model is bench/memory_scale.py's output, and its committed JSON too."""

from __future__ import annotations

import json

from bench.memory_scale import SCALES, inputs, model, table
from tests.conftest import ROOT


def test_the_docs_table_is_the_models_output():
    rows = [model(**s) for s in SCALES]
    assert table(rows) in (ROOT / "docs" / "memory-tier.md").read_text()


def test_the_committed_results_are_the_models_output():
    saved = json.loads((ROOT / "bench" / "results" / "memory_scale.json").read_text())
    assert saved == json.loads(json.dumps({"model": True, "inputs": inputs(), "scales": [model(**s) for s in SCALES]}))


def test_the_model_follows_its_formulas():
    r = model(gpus=1024, params=70e9, mtbf_h=7.9)
    assert r["nodes"] == 128
    assert abs(r["memory_per_node_gb"] - 4 * r["state_per_node_gb"]) < 1e-9  # (keep + 1) x (1 + replicas)
    assert r["lost_per_failure_s"]["memory tier"] < r["lost_per_failure_s"]["durable tier alone"]
    # a longer MTBF lengthens the memory interval (Young/Daly grows with sqrt(M))
    assert model(gpus=1024, params=70e9, mtbf_h=31.6)["memory_interval_s"] > r["memory_interval_s"]
