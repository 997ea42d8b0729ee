"""The webhook signing key: the operator's, else one made at first start and kept in the data dir."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachet.router.webhook_secret import SECRET_FILE_NAME, webhook_secret


def test_a_key_is_made_once_kept_owner_only_and_read_back(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"  # not there yet: made on first start
    first = webhook_secret("", data_dir)
    assert first.startswith("whsec_") and len(first) > 40
    path = data_dir / SECRET_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert webhook_secret("", data_dir) == first  # a restart signs with the same key
    assert [p.name for p in data_dir.iterdir()] == [SECRET_FILE_NAME]  # no drafts left behind
    assert webhook_secret("", tmp_path / "elsewhere") != first


def test_the_operators_key_wins_and_nothing_is_written(tmp_path: Path) -> None:
    assert webhook_secret("whsec_operator", tmp_path) == "whsec_operator"
    assert not (tmp_path / SECRET_FILE_NAME).exists()


def test_routers_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: webhook_secret("", tmp_path), range(32)))
    assert keys == {(tmp_path / SECRET_FILE_NAME).read_text().strip()}


def test_an_empty_key_file_stops_the_start_instead_of_signing_with_nothing(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE_NAME).write_text("\n")
    with pytest.raises(RuntimeError, match="is empty"):
        webhook_secret("", tmp_path)
