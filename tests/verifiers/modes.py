"""Which sandbox modes work here, for the tests that run a program in each. A mode that does not work skips its
tests with the reason, unless ``SCGRPO_REQUIRE_SANDBOX`` names it (``.ci/run`` names bwrap once bubblewrap is
installed; the mutation pass names every mode it measures): there a mode that stopped working fails its tests, as a
change that broke it must."""

import functools
import os

import pytest

from scgrpo.verifiers.sandbox import MODES, Sandbox, SandboxError


@functools.lru_cache(maxsize=None)
def mode_unavailable(mode):
    """Why ``mode`` does not work here (None when it does); probed once, when a test first needs it."""
    try:
        Sandbox(mode)
        return None
    except SandboxError as err:
        return f"{mode} sandbox unavailable here: {err}"


def required_modes():
    """The modes ``SCGRPO_REQUIRE_SANDBOX`` names (comma-separated; "1" names none: some mode must work)."""
    return {m.strip() for m in os.environ.get("SCGRPO_REQUIRE_SANDBOX", "").split(",")} & set(MODES)


def skip_unless(mode):
    """Skips the test where ``mode`` does not work, or fails it where that mode is required."""
    reason = mode_unavailable(mode)
    if reason is None:
        return
    if mode in required_modes():
        pytest.fail(f"{reason} (SCGRPO_REQUIRE_SANDBOX names {mode})")
    pytest.skip(reason)
