"""The report: HTML page (plotly embedded, offline), tables.md / tables.csv, and run comparison.

Public API:
- `write_report(run_dirs, out_dir=None) -> Path` (index.html; default <cwd>/reports/<run-id>/)
- `compare_runs(run_a, run_b, threshold=0.05, alpha=0.05) -> Comparison`, `write_comparison(...)`
- `load_run(run_dir) -> RunData`
"""

from benchsuite.report.build import write_report
from benchsuite.report.compare import Comparison, compare_runs, write_comparison
from benchsuite.report.load import RunData, load_run

__all__ = ["Comparison", "RunData", "compare_runs", "load_run", "write_comparison", "write_report"]
