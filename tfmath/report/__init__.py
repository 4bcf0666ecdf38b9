"""The report of ``tfmath reproduce``: a registry of experiments and the writer.

An experiment is a function that takes a :class:`RunSettings` and returns an
:class:`ExperimentResult` (figures, tables, data and a caption). It joins the
report by decorating itself with :func:`experiment` in any module of the
:mod:`tfmath.experiments` package; the report code never names experiments.
"""

from tfmath.report._registry import (
    Experiment,
    ExperimentResult,
    RunSettings,
    Table,
    experiment,
    registered_experiments,
)
from tfmath.report._writer import ReportError, build_report

__all__ = [
    "Experiment",
    "ExperimentResult",
    "ReportError",
    "RunSettings",
    "Table",
    "build_report",
    "experiment",
    "registered_experiments",
]
