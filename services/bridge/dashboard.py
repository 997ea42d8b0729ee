"""``GET /dashboard``: the caller's account at a glance, one server-rendered page.

Usage and cost per UTC day, model and session over the last ``days`` days, the cached-token
ratio and the money the prefix cache saved against uncached prices, and the account's OpenAI
batches by status with their requests by state. The figures are the usage service's
(``QueryUsage``: the ledger's exact pico-USD sums, shown to the micro-dollar, as
``cachet report`` shows them) and the router's (``ListBatches``); behind the same auth as every
other route. No script: the chart is inline SVG drawn here, so the page is one small response
that renders at once.

Operators (accounts in the router's ``CACHET_ROUTER_OPERATOR_ACCOUNTS``) also see every engine
replica: model, role, load (running and waiting requests, KV blocks used of the pool) from its
latest load report, the blocks each KV tier holds as the cache index mirrors them, and the
prefix hits the index's lookups found on it per tier with its hit ratio (``ListReplicaStatus``). The router decides who is an operator; anyone else's page asks and is
refused, and shows nothing of the replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment

from cachet.bridge.app import BackendsDep, CallerDep, _unary
from cachet.bridge.auth import Caller
from cachet.bridge.errors import BridgeError
from cachet.cache.v1 import cache_pb2
from cachet.engine.v1 import engine_pb2
from cachet.router.v1 import router_pb2
from cachet.usage.v1 import usage_pb2

api = APIRouter()

DAY_MS = 86_400_000
_MICRO_USD = Decimal("0.000001")
# Batches read for the status counts: 10 pages of 100, the newest first.
_BATCH_PAGES = 10


def usd(picousd: int) -> str:
    """Pico-USD as dollars to the micro-dollar (half to even), as `cachet report` rounds."""
    return str((Decimal(picousd) / 10**12).quantize(_MICRO_USD, rounding=ROUND_HALF_EVEN))


def ratio(row: usage_pb2.UsageRow) -> str:
    return f"{row.cached_tokens / row.prompt_tokens:.1%}" if row.prompt_tokens else "-"


@dataclass(frozen=True)
class Bar:
    label: str
    x: float
    cost_height: float
    saved_height: float
    title: str


def cost_bars(rows: list[usage_pb2.UsageRow], width: int = 720, height: int = 160) -> list[Bar]:
    """Per day (one bar each, days without use included, so the chart is a timeline), the cost
    and, stacked on it, what the cache saved, scaled to the tallest day; about ten days labelled."""
    tallest = max((row.cost_picousd + row.cache_savings_picousd for row in rows), default=0) or 1
    step = width / max(len(rows), 1)
    every = max(len(rows) // 10, 1)
    return [
        Bar(
            label=row.day[5:] if (len(rows) - 1 - index) % every == 0 else "",
            x=index * step,
            cost_height=height * row.cost_picousd / tallest,
            saved_height=height * row.cache_savings_picousd / tallest,
            title=f"{row.day}: cost ${usd(row.cost_picousd)}, saved ${usd(row.cache_savings_picousd)}",
        )
        for index, row in enumerate(rows)
    ]


_PAGE = Environment(autoescape=True).from_string(
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Cachet: {{ account }}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1f24;max-width:1100px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.muted{color:#59636e}.cards{display:flex;gap:12px;flex-wrap:wrap;margin-top:16px}
.card{border:1px solid #d1d9e0;border-radius:8px;padding:10px 14px;min-width:150px}
.card b{display:block;font-size:20px}
table{border-collapse:collapse;width:100%}th,td{padding:4px 8px;border-bottom:1px solid #eef1f4}
th{text-align:left;font-weight:600;background:#f6f8fa}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
svg text{font-size:10px;fill:#59636e}.cost{fill:#0969da}.saved{fill:#7ee2a8}
</style></head><body>
<h1>Cachet usage: {{ account }}</h1>
<div class="muted">UTC days {{ since }} to {{ until }}; prices per 1M tokens as recorded
(reference: $0.60 input, $0.10 cached input, $3.00 output).</div>
<div class="cards">
<div class="card" id="cost">Cost<b>${{ usd(total.cost_picousd) }}</b></div>
<div class="card" id="saved">Saved by the cache<b>${{ usd(total.cache_savings_picousd) }}</b></div>
<div class="card" id="uncached">Without the cache<b>${{ usd(total.cost_picousd + total.cache_savings_picousd) }}</b></div>
<div class="card" id="ratio">Cached-token ratio<b>{{ ratio(total) }}</b></div>
<div class="card" id="requests">Requests<b>{{ "{:,}".format(total.requests) }}</b></div>
</div>
<h2>Cost per day <span class="muted">(blue: cost, green: saved by the cache)</span></h2>
<svg width="740" height="190" role="img" aria-label="cost per day">
{% for bar in bars %}<g><title>{{ bar.title }}</title>
<rect class="cost" x="{{ '%.1f' % (bar.x + 10) }}" y="{{ '%.1f' % (170 - bar.cost_height) }}" width="{{ '%.1f' % bar_width }}" height="{{ '%.1f' % bar.cost_height }}"/>
<rect class="saved" x="{{ '%.1f' % (bar.x + 10) }}" y="{{ '%.1f' % (170 - bar.cost_height - bar.saved_height) }}" width="{{ '%.1f' % bar_width }}" height="{{ '%.1f' % bar.saved_height }}"/>
<text x="{{ '%.1f' % (bar.x + 10) }}" y="184">{{ bar.label }}</text></g>
{% endfor %}
</svg>
{% for title, key, rows in tables %}
<h2>{{ title }}</h2>
<table id="by-{{ key }}"><tr><th>{{ key }}</th><th class="n">requests</th><th class="n">prompt tokens</th>
<th class="n">cached tokens</th><th class="n">cached</th><th class="n">output tokens</th><th class="n">cost $</th>
<th class="n">saved $</th></tr>
{% for label, row in rows %}<tr><td>{{ label }}</td><td class="n">{{ "{:,}".format(row.requests) }}</td>
<td class="n">{{ "{:,}".format(row.prompt_tokens) }}</td><td class="n">{{ "{:,}".format(row.cached_tokens) }}</td>
<td class="n">{{ ratio(row) }}</td><td class="n">{{ "{:,}".format(row.completion_tokens) }}</td>
<td class="n">{{ usd(row.cost_picousd) }}</td><td class="n">{{ usd(row.cache_savings_picousd) }}</td></tr>
{% else %}<tr><td colspan="8" class="muted">none</td></tr>{% endfor %}
</table>
{% endfor %}
<h2>Batches</h2>
<table id="batches"><tr><th>status</th><th class="n">batches</th></tr>
{% for status, count in batch_statuses %}<tr><td>{{ status }}</td><td class="n">{{ count }}</td></tr>
{% else %}<tr><td colspan="2" class="muted">none</td></tr>{% endfor %}
</table>
<p class="muted" id="batch-requests">Batch requests: {{ batch_requests.completed }} completed,
{{ batch_requests.failed }} failed, {{ batch_requests.pending }} pending.</p>
{% if replicas is not none %}
<h2>Engine replicas <span class="muted">(operators)</span></h2>
<div class="muted">Load from each engine's latest report to the router; KV blocks per tier as the
cache index mirrors the engine's KV events{% if not replicas.cache_index_answered %} (the cache
index did not answer){% endif %}. Prefix hits: the blocks of each lookup's longest match, on
the replica that held it, by tier; hit ratio: those over the blocks its model's lookups asked for
(a model's replicas add up to its ratio). Tokens each engine reused, by tier: the Grafana dashboard
(cachet_engine_prefix_cache_hit_tokens).</div>
<table id="replicas"><tr><th>replica</th><th>model</th><th>role</th><th>state</th>
<th class="n">running</th><th class="n">waiting</th><th class="n">KV blocks used</th><th class="n">of</th>
<th class="n">pool cached</th><th class="n">host tier</th><th class="n">shared tier</th>
<th class="n">pool hits</th><th class="n">host hits</th><th class="n">shared hits</th><th class="n">hit ratio</th></tr>
{% for row in replicas.replicas %}<tr><td>{{ row.address }}</td><td>{{ row.model or "-" }}</td>
<td>{{ row.role or "-" }}</td><td>{{ state(row) }}</td>
{% if row.HasField("load") %}<td class="n">{{ row.load.running_requests }}</td>
<td class="n">{{ row.load.waiting_requests }}</td>
<td class="n"><svg width="60" height="8" role="img" aria-label="KV used"><rect width="60" height="8" fill="#eef1f4"/>
<rect class="cost" width="{{ '%.1f' % (60 * used_fraction(row.load)) }}" height="8"/></svg>
{{ "{:,}".format(row.load.total_kv_blocks - row.load.free_kv_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.load.total_kv_blocks) }}</td>
{% else %}<td class="n">-</td><td class="n">-</td><td class="n">-</td><td class="n">-</td>{% endif %}
{% if row.HasField("kv_index") %}<td class="n">{{ "{:,}".format(row.kv_index.cached_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.kv_index.host_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.kv_index.shared_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.kv_index.engine_hit_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.kv_index.host_hit_blocks) }}</td>
<td class="n">{{ "{:,}".format(row.kv_index.shared_hit_blocks) }}</td>
<td class="n">{{ hit_ratio(row.kv_index) }}</td>
{% else %}{% for _ in range(7) %}<td class="n">-</td>{% endfor %}{% endif %}</tr>
{% else %}<tr><td colspan="15" class="muted">none</td></tr>{% endfor %}
</table>
{% endif %}
</body></html>
"""
)


@dataclass(frozen=True)
class BatchRequests:
    completed: int = 0
    failed: int = 0
    pending: int = 0


async def _batches(request: Request, backends: BackendsDep, caller: Caller) -> list[router_pb2.Batch]:
    found: list[router_pb2.Batch] = []
    after = ""
    for _ in range(_BATCH_PAGES):
        page = await _unary(
            request,
            backends.inference.ListBatches,
            router_pb2.ListBatchesRequest(after=after, limit=100),
            caller,
        )
        found += page.batches
        if not page.has_more or not page.batches:
            break
        after = page.batches[-1].id
    return found


async def _replicas(
    request: Request, backends: BackendsDep, caller: Caller
) -> router_pb2.ReplicaStatusList | None:
    """The operators' view of the engine replicas, or None for anyone else (the router decides
    who is an operator: 403) and from a router that predates the view (501)."""
    try:
        return await _unary(
            request, backends.inference.ListReplicaStatus, router_pb2.ListReplicaStatusRequest(), caller
        )
    except BridgeError as refused:
        if refused.status not in (403, 501):
            raise
        return None


def _replica_state(row: router_pb2.ReplicaStatus) -> str:
    if row.available:
        return "up"
    return "stale" if row.HasField("load") else "down"


def _used_fraction(load: engine_pb2.LoadReport) -> float:
    return (
        (load.total_kv_blocks - load.free_kv_blocks) / load.total_kv_blocks if load.total_kv_blocks else 0.0
    )


def _hit_ratio(indexed: cache_pb2.ReplicaState) -> str:
    hits = indexed.engine_hit_blocks + indexed.host_hit_blocks + indexed.shared_hit_blocks
    return f"{hits / indexed.queried_blocks:.1%}" if indexed.queried_blocks else "-"


def _status_name(status: router_pb2.OpenAIBatchStatus.ValueType) -> str:
    return router_pb2.OpenAIBatchStatus.Name(status).removeprefix("OPEN_AI_BATCH_STATUS_").lower()


@api.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    days: Annotated[int, Query(ge=1, le=366, description="UTC days shown, today included.")] = 30,
) -> HTMLResponse:
    """The caller's account: usage, cost and savings per day, model and session; batches by
    status; for operators, the engine replicas' load, KV tiers and prefix hits."""
    today_ms = int(time.time() * 1000) // DAY_MS * DAY_MS
    start_ms = today_ms - (days - 1) * DAY_MS

    def query(*group_by: str) -> usage_pb2.QueryUsageRequest:
        return usage_pb2.QueryUsageRequest(account_id=caller.account_id, start_ms=start_ms, group_by=group_by)

    total, by_day, by_model, by_session, batches, replicas = await asyncio.gather(
        *(
            _unary(request, backends.usage.QueryUsage, query(*group), caller)
            for group in ((), ("day",), ("model",), ("session",))
        ),
        _batches(request, backends, caller),
        _replicas(request, backends, caller),
    )
    sessions = sorted(by_session.rows, key=lambda row: (-row.cost_picousd, row.session_id))
    used = {row.day: row for row in by_day.rows}
    every_day = [time.strftime("%Y-%m-%d", time.gmtime((start_ms + i * DAY_MS) / 1000)) for i in range(days)]
    bars = cost_bars([used.get(day) or usage_pb2.UsageRow(day=day) for day in every_day])
    page = _PAGE.render(
        account=caller.account_id,
        since=time.strftime("%Y-%m-%d", time.gmtime(start_ms / 1000)),
        until=time.strftime("%Y-%m-%d", time.gmtime(today_ms / 1000)),
        total=total.rows[0] if total.rows else usage_pb2.UsageRow(),
        bars=bars,
        bar_width=max(720 / max(len(bars), 1) - 4, 2),
        tables=[
            ("Per day (UTC)", "day", [(row.day, row) for row in by_day.rows]),
            ("Per model", "model", [(row.model, row) for row in by_model.rows]),
            (
                "Per session, the costliest first",
                "session",
                [(row.session_id or "(none)", row) for row in sessions],
            ),
        ],
        batch_statuses=sorted(Counter(_status_name(batch.status) for batch in batches).items()),
        batch_requests=BatchRequests(
            completed=sum(batch.completed for batch in batches),
            failed=sum(batch.failed for batch in batches),
            pending=sum(batch.total - batch.completed - batch.failed for batch in batches),
        ),
        replicas=replicas,
        state=_replica_state,
        used_fraction=_used_fraction,
        hit_ratio=_hit_ratio,
        usd=usd,
        ratio=ratio,
    )
    return HTMLResponse(page)
