"""The sandbox tests' mode check: a mode that does not start skips its tests, unless SCGRPO_REQUIRE_SANDBOX names it."""

import pytest

from tests.verifiers import modes


@pytest.mark.parametrize("required,outcome", [("", "skip"), ("1", "skip"), ("namespaces", "skip"),
                                              ("bwrap", "fail"), ("namespaces, bwrap", "fail")])
def test_a_broken_mode_skips_unless_it_is_required(monkeypatch, required, outcome):
    monkeypatch.setattr(modes, "mode_unavailable", lambda mode: f"{mode} sandbox unavailable here: broken")
    monkeypatch.setenv("SCGRPO_REQUIRE_SANDBOX", required)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected, match="bwrap sandbox unavailable here: broken"):
        modes.skip_unless("bwrap")


def test_a_working_mode_runs_whatever_is_required(monkeypatch):
    monkeypatch.setattr(modes, "mode_unavailable", lambda mode: None)
    monkeypatch.setenv("SCGRPO_REQUIRE_SANDBOX", "bwrap")
    assert modes.skip_unless("bwrap") is None
