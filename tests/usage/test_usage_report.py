"""`cachet report` as a user runs it, on a real ledger (a SQLite file, and a PostgreSQL schema):
per day, model and session, every cost and saving worked out by hand at the reference prices
($0.60 / 1M input, $0.10 / 1M cached input, $3.00 / 1M output)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from ledger_backends import LedgerBackend

from cachet.usage.prices import ModelPrice
from cachet.usage.records import UsageEntry

CACHET = str(Path(sys.executable).with_name("cachet"))
PRICE = ModelPrice()  # the reference prices, as the usage service's defaults


def ms(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp() * 1000)


ENTRIES = [
    # request, account, model, session, finished, prompt, cached, completion
    ("r1", "acct-a", "m1", "s1", "2026-11-23T12:00:00", 1000, 0, 100),
    ("r2", "acct-a", "m1", "s1", "2026-11-23T23:59:59", 1200, 1000, 50),
    ("r3", "acct-b", "m2", "s2", "2026-11-24T00:00:00", 2000, 1600, 400),
    ("r4", "acct-a", "m2", "", "2026-11-24T08:00:00", 10, 0, 5),
]
# By hand, in pico-USD (micro-USD per million tokens = pico-USD per token):
# r1: 1000 x 600,000 + 100 x 3,000,000                      =   900,000,000, saved 0
# r2: 200 x 600,000 + 1000 x 100,000 + 50 x 3,000,000        =   370,000,000, saved 1000 x 500,000
# r3: 400 x 600,000 + 1600 x 100,000 + 400 x 3,000,000       = 1,600,000,000, saved 1600 x 500,000
# r4: 10 x 600,000 + 5 x 3,000,000                           =    21,000,000, saved 0
COST = {"r1": 900_000_000, "r2": 370_000_000, "r3": 1_600_000_000, "r4": 21_000_000}
SAVED = {"r1": 0, "r2": 500_000_000, "r3": 800_000_000, "r4": 0}


async def _write_ledger(backend: LedgerBackend) -> None:
    ledger = await backend.open()
    try:
        entries = [
            UsageEntry(
                request_id=request,
                account_id=account,
                model=model,
                session_id=session,
                finished_at_ms=ms(finished),
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
            )
            for request, account, model, session, finished, prompt, cached, completion in ENTRIES
        ]
        await ledger.record_many([(entry, PRICE) for entry in entries])
        await ledger.record(entries[0], PRICE)  # a retry: counted once
    finally:
        await ledger.close()


def _report(backend: LedgerBackend, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CACHET_")}
    if "store_url" in backend.settings:
        env["CACHET_STORE_URL"] = str(backend.settings["store_url"])
    else:
        args = ("--ledger", str(backend.settings["database"]), *args)
    return subprocess.run([CACHET, "report", *args], env=env, capture_output=True, text=True, timeout=60)


def _money(row: dict) -> tuple[int, int, int]:
    return row["requests"], row["cost_picousd"], row["saved_picousd"]


def _expected(*requests: str) -> tuple[int, int, int]:
    return len(requests), sum(COST[r] for r in requests), sum(SAVED[r] for r in requests)


async def test_report_json_matches_the_prices_by_hand(ledger_backend: LedgerBackend) -> None:
    await _write_ledger(ledger_backend)
    done = _report(ledger_backend, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)

    total = report["total"]
    assert _money(total) == _expected("r1", "r2", "r3", "r4")
    assert (total["prompt_tokens"], total["cached_tokens"], total["completion_tokens"]) == (4210, 2600, 555)
    assert total["cached_ratio"] == round(2600 / 4210, 6)
    assert total["uncached_cost_picousd"] == 2_891_000_000 + 1_300_000_000
    assert (total["cost_usd"], total["saved_usd"], total["uncached_cost_usd"]) == (0.002891, 0.0013, 0.004191)

    assert [(row["day"], *_money(row)) for row in report["by_day"]] == [
        ("2026-11-23", *_expected("r1", "r2")),
        ("2026-11-24", *_expected("r3", "r4")),
    ]
    assert [(row["model"], *_money(row)) for row in report["by_model"]] == [
        ("m1", *_expected("r1", "r2")),
        ("m2", *_expected("r3", "r4")),
    ]
    # Costliest session first; entries without a session are one group of their own.
    assert [(row["session"], *_money(row)) for row in report["by_session"]] == [
        ("s2", *_expected("r3")),
        ("s1", *_expected("r1", "r2")),
        ("", *_expected("r4")),
    ]
    assert report["sessions"] == 3


async def test_report_filters_by_account_and_days(ledger_backend: LedgerBackend) -> None:
    await _write_ledger(ledger_backend)
    by_account = json.loads(_report(ledger_backend, "--json", "--account", "acct-a").stdout)
    assert _money(by_account["total"]) == _expected("r1", "r2", "r4")
    since = json.loads(_report(ledger_backend, "--json", "--since", "2026-11-24").stdout)
    assert _money(since["total"]) == _expected("r3", "r4")
    # --until names the last day included.
    until = json.loads(
        _report(ledger_backend, "--json", "--until", "2026-11-23", "--top-sessions", "1").stdout
    )
    assert _money(until["total"]) == _expected("r1", "r2")
    assert [row["session"] for row in until["by_session"]] == ["s1"]


async def test_report_table_for_people(ledger_backend: LedgerBackend) -> None:
    await _write_ledger(ledger_backend)
    done = _report(ledger_backend)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    print(done.stdout)  # for people reading the test log
    total = next(line for line in lines if line.startswith("total"))
    # requests, prompt, cached, ratio, output, cost, saved, uncached
    assert total.split()[1:] == ["4", "4,210", "2,600", "61.8%", "555", "0.002891", "0.001300", "0.004191"]
    day = next(line for line in lines if line.startswith("2026-11-24"))
    assert day.split()[1:] == ["2", "2,010", "1,600", "79.6%", "405", "0.001621", "0.000800", "0.002421"]
    assert any(line.startswith("(none)") for line in lines)
    assert done.stderr == ""


def test_a_missing_ledger_file_is_an_error_not_an_empty_report(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CACHET_")}
    env["CACHET_DATA_DIR"] = str(tmp_path)
    done = subprocess.run([CACHET, "report"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"no usage ledger at {tmp_path / 'usage.sqlite3'}" in done.stderr
    assert not (tmp_path / "usage.sqlite3").exists()


def test_an_unreachable_database_is_one_line_not_a_traceback() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CACHET_")}
    env["CACHET_STORE_URL"] = "postgresql://nobody@127.0.0.1:9/none"  # nothing listens on port 9
    done = subprocess.run([CACHET, "report"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("cachet report: ") and "Traceback" not in done.stderr
