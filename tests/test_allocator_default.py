"""The package's default CUDA allocator setting: expandable segments, unless the user configured the allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PROBE = ("import os, scgrpo; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), os.environ.get('PYTORCH_ALLOC_CONF'))")


def _after_import(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    clean["PYTHONPATH"] = SRC + os.pathsep + clean.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("given, expected", [
    ({}, "expandable_segments:True None"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "max_split_size_mb:128 None"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "None expandable_segments:False"),
])
def test_importing_scgrpo_sets_expandable_segments_only_where_the_user_set_nothing(given, expected):
    assert _after_import(**given) == expected
