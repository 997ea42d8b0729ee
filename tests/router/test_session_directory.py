"""The session directory: homes, KV footprints as running sums, idle expiry, a bounded size."""

from __future__ import annotations

import pytest

from cachet.router.session_directory import SessionDirectory


def test_a_session_has_the_home_of_its_last_request_and_counts_its_last_prompt() -> None:
    sessions = SessionDirectory(idle_seconds=60)
    assert sessions.home("s", now=0) == ""
    sessions.record("s", "A", 1000, now=0)
    sessions.record("t", "A", 300, now=1)
    sessions.record("s", "B", 1500, now=2)  # moved, and its conversation grew
    sessions.check_invariants()
    assert sessions.home("s", now=3) == "B"
    assert sessions.footprints(now=3) == {"A": 300, "B": 1500}


def test_idle_sessions_are_forgotten() -> None:
    sessions = SessionDirectory(idle_seconds=10)
    sessions.record("old", "A", 100, now=0)
    sessions.record("new", "B", 200, now=5)
    assert sessions.footprints(now=9.9) == {"A": 100, "B": 200}
    assert sessions.footprints(now=10) == {"B": 200}
    assert sessions.home("old", now=10) == ""
    # A request refreshes its session.
    sessions.record("new", "B", 250, now=14)
    assert sessions.home("new", now=23) == "B"
    sessions.check_invariants()
    assert len(sessions) == 1


def test_the_least_recently_seen_go_first_past_the_bound() -> None:
    sessions = SessionDirectory(idle_seconds=100, max_sessions=2)
    sessions.record("a", "A", 1, now=0)
    sessions.record("b", "A", 2, now=1)
    sessions.record("a", "A", 3, now=2)  # a is now the most recent
    sessions.record("c", "B", 4, now=3)
    assert (sessions.home("a", 4), sessions.home("b", 4), sessions.home("c", 4)) == ("A", "", "B")
    assert sessions.footprints(now=4) == {"A": 3, "B": 4}
    sessions.check_invariants()


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        SessionDirectory(idle_seconds=0)
    with pytest.raises(ValueError):
        SessionDirectory(max_sessions=0)
