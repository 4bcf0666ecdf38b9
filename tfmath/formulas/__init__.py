"""Closed forms: results computed from formulas and published constants, with no kernels.

:mod:`tfmath.formulas.accounting`
    Exact parameter counts, FLOPs per token, KV-cache and activation memory.
:mod:`tfmath.formulas.scaling`
    Scaling laws (Kaplan et al., Hoffmann et al.) and power-law fits.
"""
