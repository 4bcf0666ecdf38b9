"""Experiments of the ``tfmath reproduce`` report.

Every public module of this package is imported when the report runs; an
experiment joins the report by decorating its function with
:func:`tfmath.report.experiment`. Adding one never touches the report code.
"""
