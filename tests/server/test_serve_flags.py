"""`eyas serve` flags that map onto EngineConfig: parsing and the values they refuse."""

from __future__ import annotations

import argparse

import pytest

from eyas.cli.serve import add_arguments
from eyas.scheduler.config import EngineConfig


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_prefill_stretch_takes_a_multiple_or_off():
    assert parse().prefill_stretch == EngineConfig().prefill_stretch
    assert parse("--prefill-stretch", "2.5").prefill_stretch == 2.5
    assert parse("--prefill-stretch", "off").prefill_stretch is None


def test_a_bad_prefill_stretch_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--prefill-stretch", "fast")
    assert "expected a number > 1 or 'off', got 'fast'" in capsys.readouterr().err
