r"""A user's ``score_mod`` compiled for the tiles of one dtype, as fast as a built-in
modification.

Two things in the way Numba compiles an ordinary Python function would make a
score modification slower than the same modification built into the kernels,
and this module changes both, in the user's function's own code (its constants,
the globals it reads, its closure), never in the functions it calls:

1. ``math.tanh`` and ``numpy.tanh`` become :func:`~tfmath.kernels.cpu.tanh.tanh_scalar`.
   Numba compiles them to a libm call per score, which keeps the tile loop scalar
   (a soft cap so written ran 3 to 6 times as long as the built-in one,
   docs/benchmarks.rst); ``tanh_scalar`` is vectorised and within 2.4 ulp
   (float32) and 4.2 ulp (float64) of the exact tanh (glibc's manual gives 2). This
   is what Numba does itself, with Intel's SVML, where its llvmlite was built
   with it (pip's is not).
2. For float32 tiles, a Python ``float`` constant becomes ``numpy.float32``. To
   Numba a Python float is float64, and one constant widens the whole
   computation to float64 (half the vector width); in PyTorch's FlexAttention,
   whose semantics ``flex_attention`` follows, a Python scalar takes the dtype of
   the score it meets, and ``score / 30.0`` stays float32. Integers are left
   alone: they index positions.
"""

import hashlib
import math
import types

import numba
import numpy as np

from tfmath.kernels.cpu.tanh import tanh_scalar


def _module_with_vectorised_tanh(module):
    """A stand-in for ``module`` (``math`` or ``numpy``) whose ``tanh`` is
    :func:`tanh_scalar` and whose other attributes are the module's own objects,
    which Numba recognises by identity."""
    stand_in = types.ModuleType(module.__name__)
    stand_in.__dict__.update(vars(module))
    stand_in.tanh = tanh_scalar
    # numpy loads some attributes on first access (PEP 562).
    stand_in.__getattr__ = lambda name: getattr(module, name)
    return stand_in


_STAND_INS = {}


def _stand_in(module):
    if module.__name__ not in _STAND_INS:
        _STAND_INS[module.__name__] = _module_with_vectorised_tanh(module)
    return _STAND_INS[module.__name__]


def _converted(value, single):
    """``value`` as the recompiled function reads it."""
    if value is math.tanh or value is np.tanh:
        return tanh_scalar
    if value is math or value is np:
        return _stand_in(value)
    if single and type(value) is float:
        return np.float32(value)
    return value


def _converted_cell(cell, single):
    try:
        contents = cell.cell_contents
    except ValueError:  # a cell not yet filled
        return cell
    return types.CellType(_converted(contents, single))


def _converted_code(code, single):
    """``code`` with its float constants (and those of the code it nests) converted."""
    constants = tuple(
        _converted_code(c, single) if isinstance(c, types.CodeType) else _converted(c, single)
        for c in code.co_consts
    )
    return code.replace(co_consts=constants)


def _names_read(code):
    """The global names ``code`` and the code objects it nests read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_read(constant)
    return names


def frozen_state(function):
    """What compiling a plain Python ``function`` freezes into its machine code (Numba
    reads globals and closures as constants): the values of the globals it reads and of
    its closure, as a key that changes when they do (arrays by dtype, shape and a digest
    of their bytes; functions it calls, by their own frozen state). Empty for a Numba
    dispatcher: its own first compilation froze them, as Numba documents."""
    return _frozen_state(function, set())


def _frozen_state(function, seen):
    if not isinstance(function, types.FunctionType) or id(function) in seen:
        return ()
    seen.add(id(function))
    namespace = function.__globals__
    names = sorted(_names_read(function.__code__) & namespace.keys())
    values = [namespace[name] for name in names]
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            values.append(None)
    return tuple(_fingerprint(value, seen) for value in values)


def _fingerprint(value, seen):
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        data = np.ascontiguousarray(value).view(np.uint8)
        return ("array", value.dtype.str, value.shape, hashlib.blake2b(data).hexdigest())
    if isinstance(value, types.FunctionType):
        return ("function", id(value), _frozen_state(value, seen))
    if isinstance(value, tuple):
        return ("tuple", *(_fingerprint(item, seen) for item in value))
    if isinstance(value, bool | int | float | complex | str | bytes | np.generic):
        return (type(value).__name__, repr(value))  # repr: NaN equals itself
    return ("object", id(value))  # modules, dispatchers, classes: by identity


def score_function_for(function, dtype):
    """``function`` (a user's ``score_mod`` or its derivative: a Python function or a
    Numba dispatcher of one) compiled for ``dtype`` tiles with the changes of the
    module's docstring: a Numba dispatcher with the options of ``function``'s, if it
    was one. Any other callable is left to ``numba.njit`` as it is."""
    # njit sets nopython itself (and warns when it is passed).
    options = {k: v for k, v in getattr(function, "targetoptions", {}).items() if k != "nopython"}
    python = getattr(function, "py_func", function)
    if not isinstance(python, types.FunctionType):
        return numba.njit(function)
    single = np.dtype(dtype) == np.float32
    namespace = dict(python.__globals__)
    for name in _names_read(python.__code__) & namespace.keys():
        namespace[name] = _converted(namespace[name], single)
    closure = python.__closure__
    if closure is not None:
        closure = tuple(_converted_cell(cell, single) for cell in closure)
    recompiled = types.FunctionType(
        _converted_code(python.__code__, single), namespace, python.__name__,
        python.__defaults__, closure,
    )  # fmt: skip
    recompiled.__qualname__ = python.__qualname__
    # Bounds checked: an index beyond a captured array raises instead of reading beside it.
    return numba.njit(**{"boundscheck": True, **options})(recompiled)
