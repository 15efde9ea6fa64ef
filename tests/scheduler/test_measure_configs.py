"""`python -m eyas.scheduler.measure --configs ...`: configuration strings."""

import pytest

from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.measure import RunConfig


@pytest.mark.parametrize("text, draft, speculation, overlap", [
    ("none", "none", "auto", False),
    ("ngram:always+overlap", "ngram", "always", True),
    ("eagle3:smollm2-135m:auto", "eagle3:smollm2-135m", "auto", False),
    ("eagle3:smollm2-135m+ngram:never+overlap", "eagle3:smollm2-135m+ngram", "never", True),
    ("eagle3:runs/h+ngram:3,1,4", "eagle3:runs/h+ngram:3,1,4", "auto", False),
])
def test_configurations_parse(text, draft, speculation, overlap):
    assert RunConfig.parse(text) == RunConfig(draft, speculation, overlap)


def test_an_unknown_suffix_is_refused_with_the_accepted_ones():
    with pytest.raises(EyasError, match=r"the suffixes are \+ngram and \+suffix \(EAGLE-3\) and \+overlap"):
        RunConfig.parse("ngram+fast")


@pytest.mark.parametrize("text, draft, stretch", [
    ("none~off", "none", None),
    ("ngram:auto+overlap~2.5", "ngram", 2.5),
    ("none", "none", EngineConfig.prefill_stretch),
])
def test_a_configuration_may_set_the_prefill_stretch(text, draft, stretch):
    config = RunConfig.parse(text)
    assert (config.draft, config.prefill_stretch) == (draft, stretch)


def test_a_bad_prefill_stretch_is_refused():
    with pytest.raises(EyasError, match="~ takes a number or 'off'"):
        RunConfig.parse("none~fast")
