"""Prices: exact integer costs, defaults, and the prices file."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachet.usage.prices import PRICES_FILE_ENV, ModelPrice, PriceTable, load_price_table


def test_default_prices_are_the_reference_prices() -> None:
    price = ModelPrice()
    assert price.input_microusd_per_mtok == 600_000  # $0.60 / 1M
    assert price.cached_input_microusd_per_mtok == 100_000  # $0.10 / 1M
    assert price.output_microusd_per_mtok == 3_000_000  # $3.00 / 1M


def test_cost_bills_cached_tokens_at_their_own_price() -> None:
    price = ModelPrice()
    assert price.cost_picousd(1000, 600, 50) == 400 * 600_000 + 600 * 100_000 + 50 * 3_000_000
    assert price.cost_picousd(1000, 600, 50) == 450_000_000  # $0.00045
    assert price.cache_savings_picousd(600) == 600 * 500_000


def test_costs_stay_exact_at_the_largest_counts() -> None:
    top = 2**32 - 1
    price = ModelPrice(
        input_microusd_per_mtok=10**9, cached_input_microusd_per_mtok=10**9, output_microusd_per_mtok=10**9
    )
    cost = price.cost_picousd(top, 0, top)
    assert cost == 2 * top * 10**9 and cost < 2**63


def test_prices_file_overrides_default_and_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PRICES_FILE_ENV, raising=False)
    (tmp_path / "prices.json").write_text(
        '{"default": {"output_microusd_per_mtok": 2000000},'
        ' "models": {"big": {"input_microusd_per_mtok": 900000}}}'
    )
    table = load_price_table(tmp_path)
    assert table.default == ModelPrice(output_microusd_per_mtok=2_000_000)
    # A model entry's missing fields come from the file's default, not the built-in one.
    assert table.price_for("big") == ModelPrice(
        input_microusd_per_mtok=900_000, output_microusd_per_mtok=2_000_000
    )
    assert table.price_for("unlisted") == table.default
    assert list(table.models) == ["big"]


def test_env_variable_names_the_prices_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "conf" / "p.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text('{"models": {"m": {"cached_input_microusd_per_mtok": 0}}}')
    (tmp_path / "prices.json").write_text('{"models": {"m": {"cached_input_microusd_per_mtok": 7}}}')
    monkeypatch.setenv(PRICES_FILE_ENV, str(elsewhere))
    assert load_price_table(tmp_path).price_for("m").cached_input_microusd_per_mtok == 0


def test_no_file_means_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PRICES_FILE_ENV, raising=False)
    table = load_price_table(tmp_path)
    assert table.default == ModelPrice() and table.models == {}


def test_a_configured_file_that_is_missing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PRICES_FILE_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="absent.json"):
        load_price_table(tmp_path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"default": {"input_microusd_per_mtok": 0.6}}', "input_microusd_per_mtok"),
        ('{"default": {"input_microusd_per_mtok": "600000"}}', "input_microusd_per_mtok"),
        ('{"models": {"m": {"output_microusd_per_mtok": -1}}}', "output_microusd_per_mtok"),
        ('{"models": {"m": {"ouptut_microusd_per_mtok": 1}}}', "ouptut_microusd_per_mtok"),
        ('{"models": {"m": {"cached_input_microusd_per_mtok": 700000}}}', "cached_input_microusd_per_mtok"),
        ('{"default": {"input_microusd_per_mtok": 1000000001}}', "input_microusd_per_mtok"),
        ('{"defaults": {}}', "defaults"),
    ],
)
def test_bad_prices_are_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PriceTable.from_json(text)
