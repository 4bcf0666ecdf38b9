"""Private kernels: ``cpu`` (Numba ``@njit``) and ``cuda`` (Numba ``@cuda.jit``).

Nothing here validates its input: the public modules do that once, before any
kernel runs, and the kernels assume C-contiguous arrays of one floating dtype.
"""
