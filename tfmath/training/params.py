"""Model parameters as plain NumPy arrays: a named container and its reproducible initialisation.

Two small types, with no knowledge of transformers and no global state:

:class:`ParameterSpec`
    What a layer needs: each parameter's dotted name, shape and initialiser
    (``"normal"``, ``"zeros"`` or ``"ones"``). Specs of sub-layers combine with
    :meth:`ParameterSpec.prefixed` and :meth:`ParameterSpec.merge`.
:class:`Parameters`
    The arrays themselves, an immutable mapping from dotted names
    (``"decoder.0.self_attn.w_q"``) to ``numpy.ndarray``. Gradients use the
    same type and the same names, so an optimiser pairs them by name.

:meth:`ParameterSpec.initialize` draws each array from its own random
stream, seeded by the run's seed *and the parameter's name*: the same seed
gives the same arrays in every process, and adding or removing one parameter
leaves every other one unchanged.

Examples
--------
>>> from tfmath.training.params import ParameterSpec
>>> spec = ParameterSpec({"w": ((2, 3), "normal"), "b": ((3,), "zeros")})
>>> params = spec.initialize(seed=0)
>>> params.size, sorted(params)
(9, ['b', 'w'])
>>> bool((spec.initialize(seed=0)["w"] == params["w"]).all())
True
"""

import zlib
from collections.abc import Mapping

import numpy as np

from tfmath._contract.checks import is_half, kernel_dtype
from tfmath.errors import ArgumentError, DTypeError, ShapeError

__all__ = ["ParameterSpec", "Parameters"]

INITIALIZERS = ("normal", "zeros", "ones")


class ParameterSpec:
    """The names, shapes and initialisers of a set of parameters.

    Parameters
    ----------
    entries : dict of str to (tuple of int, str)
        ``name -> (shape, initializer)`` with initializer one of ``"normal"``
        (:math:`\\mathcal N(0, \\sigma^2)`), ``"zeros"`` or ``"ones"``.
    """

    def __init__(self, entries):
        checked = {}
        for name, (shape, initializer) in dict(entries).items():
            if initializer not in INITIALIZERS:
                raise ArgumentError(
                    f"initializer of {name!r} must be one of {INITIALIZERS}, got {initializer!r}"
                )
            checked[name] = (tuple(int(n) for n in shape), initializer)
        self.entries = checked

    def __repr__(self):
        return f"ParameterSpec({len(self.entries)} arrays, {self.size} parameters)"

    @property
    def size(self):
        """The number of scalar parameters."""
        return sum(int(np.prod(shape)) for shape, _ in self.entries.values())

    def shapes(self):
        """``name -> shape``."""
        return {name: shape for name, (shape, _) in self.entries.items()}

    def prefixed(self, prefix):
        """The same spec with every name preceded by ``prefix + "."``."""
        return ParameterSpec({f"{prefix}.{name}": entry for name, entry in self.entries.items()})

    def merge(self, *others):
        """The union of this spec and ``others``; a name may appear only once."""
        merged = dict(self.entries)
        for other in others:
            clash = merged.keys() & other.entries.keys()
            if clash:
                raise ArgumentError(f"parameter names defined twice: {sorted(clash)}")
            merged.update(other.entries)
        return ParameterSpec(merged)

    def initialize(self, seed, *, std=0.02, dtype=np.float64):
        """Draw the arrays.

        Parameters
        ----------
        seed : int
            Non-negative seed; each array's stream is seeded by ``(seed, crc32(name))``.
        std : float, optional
            Standard deviation of the ``"normal"`` arrays (0.02 as in GPT-2 and
            BERT's initialisation).
        dtype : {numpy.float64, numpy.float32}, optional

        Returns
        -------
        Parameters
        """
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ArgumentError(f"seed must be a non-negative integer, got {seed!r}")
        dtype = kernel_dtype("dtype", dtype)
        arrays = {}
        for name, (shape, initializer) in self.entries.items():
            if initializer == "normal":
                rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
                arrays[name] = (std * rng.standard_normal(shape)).astype(dtype)
            elif initializer == "zeros":
                arrays[name] = np.zeros(shape, dtype=dtype)
            else:
                arrays[name] = np.ones(shape, dtype=dtype)
        return Parameters(arrays)


class Parameters(Mapping):
    """An immutable mapping from dotted parameter names to float arrays.

    The mapping cannot be changed after construction (methods return new
    containers), but the arrays are ordinary NumPy arrays, shared, not copied,
    by :meth:`scope`, :meth:`prefixed` and :meth:`merge`.

    Parameters
    ----------
    arrays : dict of str to array_like, optional
        Each value becomes a float16, bfloat16, float32 or float64 array.

    Raises
    ------
    DTypeError
        For arrays of any other dtype.
    """

    __slots__ = ("_arrays",)

    def __init__(self, arrays=None):
        checked = {}
        for name, array in dict(arrays or {}).items():
            if not isinstance(name, str) or not name:
                raise DTypeError(f"parameter names must be non-empty strings, got {name!r}")
            array = np.asarray(array)
            if array.dtype not in (np.float32, np.float64) and not is_half(array.dtype):
                raise DTypeError(
                    f"parameter {name!r} must be float16, bfloat16, float32 or float64, "
                    f"got {array.dtype}"
                )
            checked[name] = array
        self._arrays = checked

    def __getitem__(self, name):
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r}; have {sorted(self._arrays)}") from None

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def __repr__(self):
        return f"Parameters({len(self)} arrays, {self.size} parameters)"

    # Mapping's == would compare arrays elementwise and fail on their truth value.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def size(self):
        """The number of scalar parameters."""
        return sum(a.size for a in self._arrays.values())

    def shapes(self):
        """``name -> shape``."""
        return {name: a.shape for name, a in self._arrays.items()}

    def scope(self, prefix):
        """The parameters named ``prefix.<rest>``, renamed ``<rest>`` (the arrays are shared)."""
        start = f"{prefix}."
        return Parameters(
            {name[len(start) :]: a for name, a in self._arrays.items() if name.startswith(start)}
        )

    def prefixed(self, prefix):
        """The same arrays with every name preceded by ``prefix + "."``."""
        return Parameters({f"{prefix}.{name}": a for name, a in self._arrays.items()})

    def merge(self, *others):
        """The union of this container and ``others``; a name may appear only once."""
        merged = dict(self._arrays)
        for other in others:
            clash = merged.keys() & other.keys()
            if clash:
                raise ArgumentError(f"parameter names defined twice: {sorted(clash)}")
            merged.update(other.items())
        return Parameters(merged)

    def map(self, function):
        """``Parameters({name: function(array)})``."""
        return Parameters({name: function(a) for name, a in self._arrays.items()})

    def copy(self):
        """A deep copy: new arrays with the same values."""
        return self.map(np.copy)

    def zeros_like(self):
        """Zeros of the same names, shapes and dtypes (a gradient accumulator)."""
        return self.map(np.zeros_like)

    def astype(self, dtype):
        """Every array cast to ``dtype``."""
        return self.map(lambda a: a.astype(dtype))

    def require(self, names, *, owner):
        """Raise unless every name in ``names`` is present, naming those missing and ``owner``."""
        missing = [name for name in names if name not in self._arrays]
        if missing:
            raise ShapeError(f"{owner} parameters lack {missing}; got {sorted(self._arrays)}")
