"""The OpenMP spin default (eyas/openmp_spin.py): set on import, a user's setting kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, eyas; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"


def spin_count_seen(**env: str) -> str:
    """GOMP_SPINCOUNT in a fresh interpreter after `import eyas`, started with `env` (and
    neither spin variable unless given)."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_importing_eyas_sets_a_short_spin():
    assert spin_count_seen() == "10000"


@pytest.mark.parametrize("env, expected", [({"GOMP_SPINCOUNT": "123"}, "123"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, "unset")])
def test_a_users_setting_is_kept(env, expected):
    assert spin_count_seen(**env) == expected

