"""Shared fixtures: the embedded SmolLM2 target and tiny random models built from configs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from tiny_models import build_tiny_model, single_thread

warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Training's `--precision auto` stays float32 on a CPU with AMX too, so that the training tests'
# float32 references hold on any machine (and in the subprocesses they start); the tests of the
# rule itself set it back.
os.environ["EYAS_CPU_BF16"] = "off"


@pytest.fixture(autouse=True, scope="session")
def measurements_in_a_temporary_cache(tmp_path_factory):
    """Cost models, layer-skip calibrations and machine limits that tests measure (mostly of
    tiny models in temporary folders) go to a temporary cache, not the user's ~/.cache/eyas
    (unless EYAS_CACHE is set); converted models keep using the user's cache (converting
    SmolLM2 takes ~20 s)."""
    from eyas.engine.speculative import layerskip_calibrate, sizing
    from eyas.models import probe

    folder = tmp_path_factory.mktemp("eyas-cache")
    saved = sizing.cache_dir, layerskip_calibrate.cache_dir, probe.cache_dir

    def measurement_cache() -> Path:  # a test that sets EYAS_CACHE itself gets that folder
        return saved[0]() if "EYAS_CACHE" in os.environ else folder

    sizing.cache_dir = layerskip_calibrate.cache_dir = probe.cache_dir = measurement_cache
    # the suite loads the machine itself: costs are cached as on a quiet one (the rule's own test
    # sets it), so that a test that measures twice reads its first measurement
    busy, sizing.machine_busy = sizing.machine_busy, lambda: False
    yield folder
    sizing.cache_dir, layerskip_calibrate.cache_dir, probe.cache_dir = saved
    sizing.machine_busy = busy


@pytest.fixture
def one_thread():
    """Run the test on one torch thread (use: pytestmark = pytest.mark.usefixtures("one_thread"))."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from eyas.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from eyas.engine.target import load_target

    return load_target(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="session")
def smollm_target():
    from eyas.engine.target import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm_int4_target():
    from eyas.engine.target import load_target

    return load_target("smollm2-135m", dtype="int4")


@pytest.fixture(scope="session")
def mtbench_prompt_ids(smollm_tokenizer) -> list[list[int]]:
    from eyas.bench.prompts import mtbench_first_turns
    from eyas.models.tokenizer import chat_prompt_ids

    return [chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": q}])
            for q in mtbench_first_turns(8)]
