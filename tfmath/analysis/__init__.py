"""Functions that measure the properties the seed texts claim, returning numbers.

Each submodule covers one topic (for example :mod:`tfmath.analysis.positional`
for the positional encodings); import the submodule you need. This package
imports none of them, so that importing one never pulls in the others.
"""
