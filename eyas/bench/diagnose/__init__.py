"""`eyas eval diagnose`: what limits a draft head (docs/training.md, "What limits the head").

    config.py   DiagnoseConfig
    data.py     held-out / training prompts by a fixed hash; the vocabulary counting corpus
    measure.py  greedy answers, teacher-forced target / head / layer-skip passes
    stats.py    coverage, peakedness, accuracy by confidence, acceptance-length estimate
    run.py      run_diagnose: the steps end to end -> a report dict
    report.py   format_table
"""

from eyas.bench.diagnose.config import DiagnoseConfig
from eyas.bench.diagnose.report import format_table
from eyas.bench.diagnose.run import run_diagnose

__all__ = ["DiagnoseConfig", "format_table", "run_diagnose"]
