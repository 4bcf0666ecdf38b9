r"""The full BLAS matrix product, :math:`C \leftarrow \alpha\, op(A)\, op(B) + \beta C`,
callable from CPU kernels.

``np.dot`` in a kernel computes only :math:`C = A B`. Attention's tiles need
the rest of ``gemm``: :math:`\beta = 1` adds a tile's product straight into a
gradient instead of into a temporary that a second pass adds up, and
:math:`\alpha` applies the softmax scale inside the product instead of in a
pass over a scaled copy of the inputs.

The product is the BLAS that ``np.dot`` calls: Numba's C helper
``numba_xxgemm``, which forwards to SciPy's ``scipy.linalg.cython_blas``
(OpenBLAS in SciPy's wheels). Calling it by its symbol, as Numba's own
``np.dot`` does, keeps the kernels cacheable; a ``ctypes`` function pointer
would bake a process's address into the cache. The helper's signature is
Numba's (``numba.np.linalg._BLAS.numba_xxgemm``); ``tests/test_attention.py``
checks this wrapper against NumPy on every transpose combination, so a
change to it on a Numba upgrade fails there first.
"""

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.linalg import ensure_blas

from tfmath._jit import cpu_kernel

ensure_blas()

_TRANSPOSE = ord("t")
_NO_TRANSPOSE = ord("n")

#: How each argument of ``numba_xxgemm`` after its leading ``kind`` character is
#: passed: a character, an integer, a pointer to a scalar, or an array's data.
_ARGUMENT_KINDS = (
    "char", "char", "intp", "intp", "intp",  # transa, transb, m, n, k
    "scalar", "array", "intp",  # alpha, a, lda
    "array", "intp",  # b, ldb
    "scalar", "array", "intp",  # beta, c, ldc
)  # fmt: skip


@intrinsic
def _xxgemm(typingctx, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Column-major ``gemm`` on the data of arrays ``a``, ``b`` and ``c`` of one float
    dtype; ``transpose_*`` are the BLAS characters ``'n'``/``'t'`` as integers.
    Returns the helper's status (non-zero if no BLAS could be loaded)."""
    operand_types = (a, b, c)
    if not all(isinstance(t, types.Array) for t in operand_types):
        return None
    dtype = c.dtype
    if dtype not in (types.float32, types.float64) or a.dtype != dtype or b.dtype != dtype:
        return None
    gemm_signature = types.intc(
        transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
    )

    def codegen(context, builder, signature, args):
        char = ir.IntType(8)
        intp = context.get_value_type(types.intp)
        void_pointer = char.as_pointer()
        llvm_types = {"char": char, "intp": intp, "scalar": void_pointer, "array": void_pointer}

        def lower(kind, value, value_type):
            if kind == "array":
                array = context.make_array(value_type)(context, builder, value)
                return builder.bitcast(array.data, void_pointer)
            if kind == "scalar":
                slot = cgutils.alloca_once_value(
                    builder, context.cast(builder, value, value_type, dtype)
                )
                return builder.bitcast(slot, void_pointer)
            as_intp = context.cast(builder, value, value_type, types.intp)
            return builder.trunc(as_intp, char) if kind == "char" else as_intp

        function_type = ir.FunctionType(
            ir.IntType(32), [char] + [llvm_types[kind] for kind in _ARGUMENT_KINDS]
        )
        function = cgutils.get_or_insert_function(builder.module, function_type, "numba_xxgemm")
        blas_kind = ir.Constant(char, ord("s" if dtype == types.float32 else "d"))
        operands = [
            lower(kind, value, value_type)
            for kind, value, value_type in zip(_ARGUMENT_KINDS, args, signature.args, strict=True)
        ]
        return builder.call(function, [blas_kind, *operands])

    return gemm_signature, codegen


@cpu_kernel
def _leading_dimension(array):
    """Elements between consecutive rows of a 2-D array whose rows are contiguous."""
    if array.shape[1] > 1 and array.strides[1] != array.itemsize:
        raise ValueError("gemm: every operand needs contiguous rows")
    return max(array.strides[0] // array.itemsize, array.shape[1], 1)


@cpu_kernel
def gemm(alpha, a, b, beta, c, transpose_a=False, transpose_b=False):
    r"""``c = alpha * op(a) @ op(b) + beta * c`` in place, for row-major 2-D arrays
    of one float dtype with contiguous rows; ``op(x)`` is ``x.T`` when
    ``transpose_x``. With ``beta == 0``, ``c``'s old contents are never read.

    The kernels pass ``alpha`` and ``beta`` as floats: Numba types an integer
    constant as a literal of its value, so ``beta=0`` and ``beta=1`` would compile
    this function twice, and a cold first call pays for every compilation."""
    m, n = c.shape
    k = a.shape[0] if transpose_a else a.shape[1]
    if (a.shape[1] if transpose_a else a.shape[0]) != m or (
        (b.shape[1] if transpose_b else b.shape[0]) != k
        or (b.shape[0] if transpose_b else b.shape[1]) != n
    ):
        raise ValueError("gemm: operand shapes do not match")
    if m == 0 or n == 0:
        return
    if k == 0:
        for i in range(m):
            for j in range(n):
                c[i, j] = 0 if beta == 0 else beta * c[i, j]
        return
    # A row-major matrix is the column-major storage of its transpose, so
    # C^T = op(B)^T op(A)^T is the column-major product BLAS computes.
    status = _xxgemm(
        _TRANSPOSE if transpose_b else _NO_TRANSPOSE,
        _TRANSPOSE if transpose_a else _NO_TRANSPOSE,
        n, m, k, alpha,
        b, _leading_dimension(b),
        a, _leading_dimension(a),
        beta, c, _leading_dimension(c),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError("gemm: no BLAS could be loaded (SciPy's cython_blas is needed)")


@cpu_kernel
def transpose_into(rows, columns):
    """``columns[e, i] = rows[i, e]``, for the small products of attention.

    OpenBLAS's small-matrix kernels run those products at speeds that depend on
    their form, not only on their size: ``(64, 8) @ (8, 64)`` runs faster than
    ``(64, 8) @ (64, 8).T``, and ``(64, 64).T @ (64, 8)`` faster than
    ``(64, 64) @ (64, 8)``. The attention kernels take the fast forms, storing a
    tile by feature with this copy where one is needed, which costs a fraction of
    what the fast form saves (see docs/benchmarks.rst, "Measurements behind
    constants").
    """
    for i in range(rows.shape[0]):
        for e in range(rows.shape[1]):
            columns[e, i] = rows[i, e]
