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


def test_warm_rounds_are_left_out_and_each_round_is_paired_with_the_first_configuration(
        tiny_model_dir, tmp_path):
    import json

    from eyas.scheduler.measure import main

    out = tmp_path / "measure.json"
    assert main(["--model", str(tiny_model_dir), "--dtype", "float32", "--num-prompts", "2",
                 "--max-tokens", "4", "--configs", "none", "ngram:always", "--concurrency", "2",
                 "--warmup", "1", "--rounds", "3", "--check-plain", "--json", str(out)]) == 0
    rows = {row["config"]: row for row in json.loads(out.read_text())["results"]}
    assert len(rows["none"]["rounds_tokens_per_s"]) == 3  # the warm-up round not among them
    assert rows["none"]["ratios"] == [1.0, 1.0, 1.0] and rows["none"]["median_ratio"] == 1.0
    paired = [round(n / p, 3) for n, p in zip(rows["ngram:always"]["rounds_tokens_per_s"],
                                              rows["none"]["rounds_tokens_per_s"])]
    assert rows["ngram:always"]["ratios"] == pytest.approx(paired, abs=2e-3)
    assert rows["ngram:always"]["median_ratio"] == sorted(rows["ngram:always"]["ratios"])[1]
    assert rows["none"]["equal_to_plain"] and rows["ngram:always"]["equal_to_plain"]


def test_rounds_and_warmup_are_checked(tiny_model_dir):
    from eyas.scheduler.measure import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir), "--rounds", "0"])
