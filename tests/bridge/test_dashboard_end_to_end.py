"""GET /dashboard after real traffic: the caller's account only, behind the API key, every figure
equal to the ledger's to the micro-dollar (the ledger read straight from the usage service); for
an operator, the engine replicas' load, KV tiers and prefix hits equal to what the engines and the
cache index report themselves and to what the requests sent must have hit, which no other account
sees."""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path

import grpc
import httpx
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

KEYS = {"sk-dash-a": "acct-dash-a", "sk-dash-b": "acct-dash-b", "sk-dash-ops": "acct-dash-ops"}
OPERATORS = json.dumps(["acct-dash-ops"])
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CachetStack, ServiceProcess]]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("dashboard-e2e")
    keys = json.dumps(KEYS)
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID))
    stack.start(
        engines=2,
        router_env={"CACHET_ROUTER_API_KEYS": keys, "CACHET_ROUTER_OPERATOR_ACCOUNTS": OPERATORS},
    )
    try:
        yield stack, stack.start_bridge(CACHET_BRIDGE_API_KEYS=keys, CACHET_BRIDGE_HOST="127.0.0.1")
    finally:
        stack.stop()


def _chat(bridge: ServiceProcess, key: str, session: str, system: str) -> dict:
    answer = httpx.post(
        f"http://{bridge.address}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}", "x-session-affinity": session},
        json={
            "model": TINY_MODEL_ID,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi there?"}],
            "max_tokens": 3,
            "temperature": 0,
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def _ledger(stack: CachetStack, account: str, *group_by: str) -> list[usage_pb2.UsageRow]:
    with grpc.insecure_channel(stack.address("usage")) as channel:
        reply = usage_pb2_grpc.UsageServiceStub(channel).QueryUsage(
            usage_pb2.QueryUsageRequest(account_id=account, group_by=group_by), timeout=10
        )
    return list(reply.rows)


def _usd(picousd: int) -> str:
    return str((Decimal(picousd) / 10**12).quantize(Decimal("0.000001")))


class _Cells(HTMLParser):
    """Card values by id, and each table's rows as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, str] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self._card = self._table = None
        self._in_bold = self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = dict(attrs)
        if tag == "div" and found.get("class") == "card":
            self._card = found["id"]
        elif tag == "b" and self._card:
            self._in_bold = True
        elif tag == "table":
            self._table = found["id"]
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            self._in_cell = True
            self.tables[self._table][-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "b":
            self._in_bold = False
            self._card = None
        elif tag in ("td", "th"):
            self._in_cell = False
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._in_bold and self._card:
            self.cards[self._card] = self.cards.get(self._card, "") + data.strip()
        elif self._in_cell and self._table:
            self.tables[self._table][-1][-1] += data.strip()


def test_the_dashboard_shows_the_callers_ledger_to_the_micro_dollar(platform) -> None:
    stack, bridge = platform
    system = f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more."
    _chat(bridge, "sk-dash-a", "s1", system)
    _chat(bridge, "sk-dash-a", "s1", system)  # the same prefix: cached
    _chat(bridge, "sk-dash-a", "s2", "Another conversation altogether.")
    _chat(bridge, "sk-dash-b", "s9", system)  # another account's: not on A's page
    deadline = time.monotonic() + 30
    while sum(row.requests for row in _ledger(stack, "acct-dash-a")) < 3:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)

    assert httpx.get(f"http://{bridge.address}/dashboard", timeout=30).status_code == 401
    page = httpx.get(
        f"http://{bridge.address}/dashboard", headers={"authorization": "Bearer sk-dash-a"}, timeout=30
    )
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    cells = _Cells()
    cells.feed(page.text)

    (total,) = _ledger(stack, "acct-dash-a")
    assert total.requests == 3 and total.cached_tokens > 0
    assert cells.cards["cost"] == f"${_usd(total.cost_picousd)}"
    assert cells.cards["saved"] == f"${_usd(total.cache_savings_picousd)}"
    assert cells.cards["uncached"] == f"${_usd(total.cost_picousd + total.cache_savings_picousd)}"
    assert cells.cards["ratio"] == f"{total.cached_tokens / total.prompt_tokens:.1%}"
    assert cells.cards["requests"] == "3"

    def shown(table: str) -> dict[str, list[str]]:
        return {row[0]: row[1:] for row in cells.tables[table][1:]}

    for table, field in (("by-day", "day"), ("by-model", "model"), ("by-session", "session_id")):
        rows = _ledger(stack, "acct-dash-a", field.removesuffix("_id"))
        assert shown(table) == {
            getattr(row, field): [
                f"{row.requests:,}",
                f"{row.prompt_tokens:,}",
                f"{row.cached_tokens:,}",
                f"{row.cached_tokens / row.prompt_tokens:.1%}",
                f"{row.completion_tokens:,}",
                _usd(row.cost_picousd),
                _usd(row.cache_savings_picousd),
            ]
            for row in rows
        }, table
    assert set(shown("by-session")) == {"s1", "s2"}
    assert "s9" not in page.text
    assert re.search(r"Batch requests: 0 completed,\s+0 failed, 0 pending", page.text)


def _indexed(stack: CachetStack) -> dict[str, cache_pb2.ReplicaState]:
    with grpc.insecure_channel(stack.address("cache")) as channel:
        reply = cache_pb2_grpc.CacheIndexServiceStub(channel).ListReplicas(
            cache_pb2.ListReplicasRequest(), timeout=10
        )
    return {state.address: state for state in reply.replicas}


def _engine_report(address: str) -> tuple[engine_pb2.EngineInfo, engine_pb2.LoadReport]:
    with grpc.insecure_channel(address) as channel:
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        info = engine.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=10)
        reports = engine.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=100), timeout=10)
        report = next(reports)
        reports.cancel()
    return info, report


def _page(bridge: ServiceProcess, key: str) -> str:
    page = httpx.get(
        f"http://{bridge.address}/dashboard", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    assert page.status_code == 200, page.text
    return page.text


def _hits(state: cache_pb2.ReplicaState) -> tuple[int, int, int, int]:
    """Pool, host and shared hit blocks, and the blocks asked of the replica's model."""
    return state.engine_hit_blocks, state.host_hit_blocks, state.shared_hit_blocks, state.queried_blocks


def _minus(after: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(after, before, strict=True))


def _expected_replica_row(address: str, index) -> list[str]:
    """The dashboard row of a replica as its engine and the cache index (``index``: its entry
    of the index's reply) report it now."""
    info, report = _engine_report(address)
    hits = index.engine_hit_blocks + index.host_hit_blocks + index.shared_hit_blocks
    return [
        address,
        info.model,
        info.role,
        "up",
        str(report.running_requests),
        str(report.waiting_requests),
        f"{report.total_kv_blocks - report.free_kv_blocks:,}",
        f"{info.total_kv_blocks:,}",
        f"{index.cached_blocks:,}",
        f"{index.host_blocks:,}",
        f"{index.shared_blocks:,}",
        f"{index.engine_hit_blocks:,}",
        f"{index.host_hit_blocks:,}",
        f"{index.shared_hit_blocks:,}",
        f"{hits / index.queried_blocks:.1%}" if index.queried_blocks else "-",
    ]


def test_operators_see_each_replicas_load_kv_tiers_and_prefix_hits_and_no_one_else_does(platform) -> None:
    stack, bridge = platform
    addresses = stack.engine_addresses
    block_size = _engine_report(addresses[0])[0].block_size
    # With two replicas the router asks the index where a prompt's prefix lives (with one it
    # need not), so the index counts each lookup. A new prompt, then the same prompt again.
    system = f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more."
    start = _indexed(stack)
    prompt_tokens = _chat(bridge, "sk-dash-ops", "ops", system)["usage"]["prompt_tokens"]
    blocks = prompt_tokens // block_size
    assert blocks >= 1
    # The prompt is new, so its blocks are new: wait until the index mirrors them on the replica
    # that served it, so that the second lookup finds them.
    deadline = time.monotonic() + 30
    while True:
        first = _indexed(stack)
        grown = [a for a in addresses if first[a].cached_blocks >= start[a].cached_blocks + blocks]
        if grown:
            break
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    (served,) = grown
    _chat(bridge, "sk-dash-ops", "ops", system)
    second = _indexed(stack)  # the router's lookup was answered before the request was placed

    for address in addresses:
        # The first lookup found nothing anywhere; it charged its blocks to every replica the
        # index knew to serve the model (one that holds blocks: none is ever evicted here).
        charged = blocks if start[address].cached_blocks else 0
        assert _minus(_hits(first[address]), _hits(start[address])) == (0, 0, 0, charged), address
        # The second found the whole prompt in the pool of the replica that served the first.
        found = (blocks, 0, 0) if address == served else (0, 0, 0)
        charged = blocks if first[address].cached_blocks else 0
        assert _minus(_hits(second[address]), _hits(first[address])) == (*found, charged), address

    # Idle after the requests, the figures hold still. The index may still be taking its KV
    # events, and the router shows each replica's load from its last load report (sent every
    # interval), so read the index on both sides of the page and keep a reading where the two
    # agree and the page shows the replicas as their engines report them now.
    deadline = time.monotonic() + 30
    while True:
        before = _indexed(stack)
        text = _page(bridge, "sk-dash-ops")
        after = _indexed(stack)
        cells = _Cells()
        cells.feed(text)
        header, *rows = cells.tables["replicas"]
        expected = [_expected_replica_row(address, after[address]) for address in addresses]
        if before == after and rows == expected:
            break
        assert time.monotonic() < deadline, (rows, expected, stack.logs())
        time.sleep(0.2)
    assert _hits(after[served]) == _hits(second[served])
    assert header == [
        "replica", "model", "role", "state", "running", "waiting", "KV blocks used", "of",
        "pool cached", "host tier", "shared tier", "pool hits", "host hits", "shared hits",
        "hit ratio",
    ]  # fmt: skip
    for address in addresses:
        info, report = _engine_report(address)
        assert (info.role, report.running_requests, report.waiting_requests) == ("mixed", 0, 0)
    # The served replica's row: at least the second request's hit, a ratio to go with it.
    (served_row,) = [row for row in rows if row[0] == served]
    assert int(served_row[11].replace(",", "")) >= blocks and served_row[14] != "-"

    # Anyone else: no section on the page, and the router refuses the RPC itself.
    for key in ("sk-dash-a", "sk-dash-b"):
        other = _page(bridge, key)
        assert 'id="replicas"' not in other and "Engine replicas" not in other
        assert not any(address in other for address in addresses)
    with grpc.insecure_channel(stack.address("router")) as channel:
        router = router_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            router.ListReplicaStatus(
                router_pb2.ListReplicaStatusRequest(),
                metadata=[("authorization", "Bearer sk-dash-a")],
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        status = router.ListReplicaStatus(
            router_pb2.ListReplicaStatusRequest(),
            metadata=[("authorization", "Bearer sk-dash-ops")],
            timeout=10,
        )
    assert status.cache_index_answered and [r.address for r in status.replicas] == addresses
    # The router passes the index's hit counts through as the index gives them.
    assert [_hits(r.kv_index) for r in status.replicas] == [_hits(after[a]) for a in addresses]


def test_the_dashboard_renders_in_headless_chromium_with_the_ledgers_numbers(platform) -> None:
    """The page as a browser draws it (Debian's chromium through Selenium): the cards and the
    chart show the ledger's figures; a screenshot is left in data/screenshots/ for people."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    stack, bridge = platform
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        # make test installs them from Debian's packages; a machine that cannot reach them
        # still runs every other check of the page (the HTML test above).
        pytest.skip("needs Debian's chromium and chromium-driver (make test installs them)")
    _chat(bridge, "sk-dash-b", "s8", f"[{uuid.uuid4().hex}] Say hello in one short sentence, please.")
    deadline = time.monotonic() + 30
    while not _ledger(stack, "acct-dash-b"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        # The same auth as every route: the API key in the Authorization header.
        chrome.execute_cdp_cmd("Network.enable", {})
        chrome.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"authorization": "Bearer sk-dash-b"}}
        )
        chrome.get(f"http://{bridge.address}/dashboard")
        cards = {
            card.get_attribute("id"): card.find_element(By.TAG_NAME, "b").text
            for card in chrome.find_elements(By.CSS_SELECTOR, "div.card")
        }
        bars = [
            (bar.location["x"], bar.size["height"])
            for bar in chrome.find_elements(By.CSS_SELECTOR, "svg rect.cost")
        ]
        screenshot = ROOT / "data" / "screenshots" / "dashboard.png"
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert chrome.save_screenshot(str(screenshot))
        print(f"dashboard screenshot: {screenshot}")
        # An operator's page: the replicas' table below the account's figures.
        chrome.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"authorization": "Bearer sk-dash-ops"}}
        )
        chrome.get(f"http://{bridge.address}/dashboard")
        replica_rows = [
            [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in chrome.find_elements(By.CSS_SELECTOR, "table#replicas tr")[1:]
        ]
        kv_bar = chrome.find_element(By.CSS_SELECTOR, "table#replicas svg")
        kv_bar_width = kv_bar.size["width"]
        chrome.execute_script("arguments[0].scrollIntoView()", kv_bar)
        operator_shot = screenshot.with_name("dashboard-operator.png")
        assert chrome.save_screenshot(str(operator_shot))
        print(f"operator dashboard screenshot: {operator_shot}")
    finally:
        chrome.quit()
    (total,) = _ledger(stack, "acct-dash-b")
    assert cards["cost"] == f"${_usd(total.cost_picousd)}"
    assert cards["saved"] == f"${_usd(total.cache_savings_picousd)}"
    assert cards["requests"] == f"{total.requests:,}"
    # A bar a day for the 30 days shown; today's, the only one with traffic, at full height.
    assert len(bars) == 30
    assert max(bars)[1] > 100 and all(height == 0 for _, height in sorted(bars)[:-1])
    # One row per engine replica, drawn with its address, role and state, and a KV bar in view.
    assert [row[:4] for row in replica_rows] == [
        [address, TINY_MODEL_ID, "mixed", "up"] for address in stack.engine_addresses
    ]
    assert kv_bar_width == 60
