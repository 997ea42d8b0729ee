"""The Grafana dashboard (deploy/grafana/cachet-dashboard.json) loads and covers what issue 30 asks
of it; that every series it plots is exported is checked against live services in
tests/e2e/test_metrics_end_to_end.py."""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "cachet-dashboard.json"


def test_the_dashboard_is_well_formed_and_covers_serving_cache_queue_load_and_cost() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        assert grid["x"] + grid["w"] <= 24
        cells |= area
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    queries = " ".join(target["expr"] for panel in panels for target in panel["targets"])
    for series in (
        "cachet_router_time_to_first_token_seconds_bucket",  # TTFT percentiles
        "cachet_router_time_per_output_token_seconds_bucket",  # TPOT percentiles
        "cachet_engine_generated_tokens_total",  # tokens/s
        'kind="cached"',  # cached-token ratio, per model
        "cachet_engine_prefix_cache_hit_tokens_total",  # ...and per tier
        "cachet_router_queue_jobs",  # queue depth
        "cachet_router_queue_job_stage_seconds_bucket",  # queue age by stage
        "cachet_engine_requests_running",  # replica load
        "cachet_usage_cost_usd_total",  # cost
        "cachet_usage_cache_savings_usd_total",  # savings
        "cachet_engine_kv_block_copy_bytes_total",  # KV moved between tiers
        "cachet_engine_kv_retained_blocks",  # retention
        "cachet_router_prefill_handoffs_total",  # disaggregated prefill
        "cachet_tokenizer_image_cache_hits_total",  # images not prepared again
    ):
        assert series in queries, series
