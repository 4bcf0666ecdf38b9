"""Exceptions raised by tfmath.

Every error tfmath raises on bad input is a subclass of the built-in exception a
NumPy user would expect (``ValueError`` or ``TypeError``), so ``except ValueError``
keeps working, while ``except tfmath.TfmathError`` catches only ours.
"""


class TfmathError(Exception):
    """Base class of every exception tfmath raises on purpose."""


class ShapeError(TfmathError, ValueError):
    """An argument has a shape that does not fit the others."""


class DTypeError(TfmathError, TypeError):
    """An argument has a dtype (or type) the routine cannot honour."""


class LayoutError(DTypeError):
    """An argument is stored in a layout tfmath cannot read (a sparse or MKL-DNN tensor)."""


class ArgumentError(TfmathError, ValueError):
    """An argument has a value the routine cannot accept: out of range, or an unknown option."""


class BackendUnavailableError(TfmathError, ValueError):
    """The requested backend is unknown, cannot run on this machine, or cannot run this
    problem (a size beyond its kernel's limit)."""


class AllocationError(TfmathError, MemoryError):
    """A call would need more memory than the machine has; refused before any work."""


class FitWarning(UserWarning):
    """A fit left data out, or some of its resamples: the result stands on less than given."""
