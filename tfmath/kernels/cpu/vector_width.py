"""Let LLVM vectorise a kernel with the machine's widest vectors.

On AVX-512 machines LLVM tunes for 256-bit vectors by default (wide vectors
once lowered the clock of some Intel chips), so the exponential and the other
elementwise loops of attention run at half the width the hardware has. LLVM
reads a per-function attribute, ``"prefer-vector-width"``, that overrides the
preference for one function without touching the rest of the process, and
Numba has no option for it; :func:`prefer_wide_vectors`, called anywhere in
a kernel, sets it on the function being compiled. Inside a ``prange`` loop it
must be called in the loop body, which Numba compiles as a function of its
own. On machines without 512-bit vectors the attribute has no effect; on an
AVX-512 machine it made the flash attention kernels a few percent faster (see
docs/benchmarks.rst, "Measurements behind constants").
"""

from numba.core import types
from numba.extending import intrinsic

#: The vector width, in bits, the attention kernels ask LLVM to prefer.
PREFERRED_VECTOR_BITS = 512


@intrinsic
def prefer_wide_vectors(typingctx):
    """Ask LLVM to vectorise the calling function with ``PREFERRED_VECTOR_BITS``-bit vectors."""

    def codegen(context, builder, signature, args):
        attribute = f'"prefer-vector-width"="{PREFERRED_VECTOR_BITS}"'
        # llvmlite's attribute set accepts only the attributes it knows by name;
        # LLVM accepts any "key"="value" string attribute, which this is.
        set.add(builder.function.attributes, attribute)
        return context.get_dummy_value()

    return types.none(), codegen
