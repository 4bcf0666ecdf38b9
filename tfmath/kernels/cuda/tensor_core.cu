// Warp-level matrix products on the tensor cores for tfmath's half-precision
// flash attention (tfmath/kernels/cuda/tensor_core.py), linked into its Numba
// kernels with numba-cuda's `link=` and compiled by NVRTC.
//
// Each function is called by all 32 threads of a warp and computes a 16-row
// slab of C (float32, row-major, in shared memory) with `mma.sync.m16n8k16`,
// which multiplies a 16x16 half-precision tile of A by a 16x8 tile of B and
// accumulates in float32. The fragments are gathered from shared memory with
// the layout the PTX ISA gives for this shape ("Matrix Fragments for
// mma.m16n8k16 with floating point type"): thread `lane` holds rows
// g = lane / 4 and g + 8, and columns 2 * (lane % 4) + {0, 1} (+ 8).
// Half-precision numbers travel as their 16-bit patterns (unsigned short), so
// the Numba side only copies bits.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace {

struct F16 {
    static __device__ unsigned short from_float(float x) {
        return __half_as_ushort(__float2half_rn(x));
    }
    static __device__ float to_float(unsigned short x) {
        return __half2float(__ushort_as_half(x));
    }
};

struct BF16 {
    static __device__ unsigned short from_float(float x) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    static __device__ float to_float(unsigned short x) {
        return __bfloat162float(__ushort_as_bfloat16(x));
    }
};

__device__ unsigned pack(unsigned short low, unsigned short high) {
    return static_cast<unsigned>(low) | (static_cast<unsigned>(high) << 16);
}

template <bool BF>
__device__ void mma_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    if (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// A's fragment at (row 0, column k0) of a row-major 16-bit tile with stride lda.
__device__ void load_a_bits(unsigned a[4], const unsigned short* A, int lda, int k0, int lane) {
    int g = lane >> 2, c = 2 * (lane & 3);
    const unsigned short* top = A + g * lda + k0 + c;
    const unsigned short* bottom = top + 8 * lda;
    a[0] = pack(top[0], top[1]);
    a[1] = pack(bottom[0], bottom[1]);
    a[2] = pack(top[8], top[9]);
    a[3] = pack(bottom[8], bottom[9]);
}

// The same fragment from a float32 tile, rounded to the 16-bit type T.
template <class T>
__device__ void load_a_float(unsigned a[4], const float* A, int lda, int k0, int lane) {
    int g = lane >> 2, c = 2 * (lane & 3);
    const float* top = A + g * lda + k0 + c;
    const float* bottom = top + 8 * lda;
    a[0] = pack(T::from_float(top[0]), T::from_float(top[1]));
    a[1] = pack(T::from_float(bottom[0]), T::from_float(bottom[1]));
    a[2] = pack(T::from_float(top[8]), T::from_float(top[9]));
    a[3] = pack(T::from_float(bottom[8]), T::from_float(bottom[9]));
}

// B's fragment for columns n0..n0+7 and rows k0..k0+15 of B = Bt^T, Bt row-major
// (n x k, stride ldb): each thread's pairs are consecutive in memory.
__device__ void load_b_transposed(unsigned b[2], const unsigned short* Bt, int ldb, int n0,
                                  int k0, int lane) {
    const unsigned short* p = Bt + (n0 + (lane >> 2)) * ldb + k0 + 2 * (lane & 3);
    b[0] = pack(p[0], p[1]);
    b[1] = pack(p[8], p[9]);
}

// B's fragment from a row-major B (k x n, stride ldb).
__device__ void load_b(unsigned b[2], const unsigned short* B, int ldb, int n0, int k0,
                       int lane) {
    const unsigned short* p = B + (k0 + 2 * (lane & 3)) * ldb + n0 + (lane >> 2);
    b[0] = pack(p[0], p[ldb]);
    b[1] = pack(p[8 * ldb], p[9 * ldb]);
}

__device__ void load_c(float c[4], const float* C, int ldc, int n0, int lane) {
    const float* top = C + (lane >> 2) * ldc + n0 + 2 * (lane & 3);
    c[0] = top[0];
    c[1] = top[1];
    c[2] = top[8 * ldc];
    c[3] = top[8 * ldc + 1];
}

__device__ void store_c(float* C, int ldc, int n0, int lane, const float c[4]) {
    float* top = C + (lane >> 2) * ldc + n0 + 2 * (lane & 3);
    top[0] = c[0];
    top[1] = c[1];
    top[8 * ldc] = c[2];
    top[8 * ldc + 1] = c[3];
}

// C[16 x n] (+)= A[16 x k] . Bt[n x k]^T, A and Bt 16-bit: the scores Q K^T.
template <bool BF>
__device__ void product_nt(float* C, int ldc, const unsigned short* A, int lda,
                           const unsigned short* Bt, int ldb, int n, int k, int accumulate) {
    int lane = threadIdx.x & 31;
    for (int n0 = 0; n0 < n; n0 += 8) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        if (accumulate) load_c(c, C, ldc, n0, lane);
        for (int k0 = 0; k0 < k; k0 += 16) {
            unsigned a[4], b[2];
            load_a_bits(a, A, lda, k0, lane);
            load_b_transposed(b, Bt, ldb, n0, k0, lane);
            mma_16816<BF>(c, a, b);
        }
        store_c(C, ldc, n0, lane, c);
    }
}

// C[16 x n] (+)= A[16 x k] . B[k x n], A float32 (rounded to 16 bits), B 16-bit:
// the output update P V.
template <bool BF, class T>
__device__ void product_nn(float* C, int ldc, const float* A, int lda, const unsigned short* B,
                           int ldb, int n, int k, int accumulate) {
    int lane = threadIdx.x & 31;
    for (int n0 = 0; n0 < n; n0 += 8) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        if (accumulate) load_c(c, C, ldc, n0, lane);
        for (int k0 = 0; k0 < k; k0 += 16) {
            unsigned a[4], b[2];
            load_a_float<T>(a, A, lda, k0, lane);
            load_b(b, B, ldb, n0, k0, lane);
            mma_16816<BF>(c, a, b);
        }
        store_c(C, ldc, n0, lane, c);
    }
}

}  // namespace

extern "C" {

__device__ void tfmath_mma_nt_f16(float* C, int ldc, const unsigned short* A, int lda,
                                  const unsigned short* Bt, int ldb, int n, int k,
                                  int accumulate) {
    product_nt<false>(C, ldc, A, lda, Bt, ldb, n, k, accumulate);
}

__device__ void tfmath_mma_nt_bf16(float* C, int ldc, const unsigned short* A, int lda,
                                   const unsigned short* Bt, int ldb, int n, int k,
                                   int accumulate) {
    product_nt<true>(C, ldc, A, lda, Bt, ldb, n, k, accumulate);
}

__device__ void tfmath_mma_nn_f16(float* C, int ldc, const float* A, int lda,
                                  const unsigned short* B, int ldb, int n, int k,
                                  int accumulate) {
    product_nn<false, F16>(C, ldc, A, lda, B, ldb, n, k, accumulate);
}

__device__ void tfmath_mma_nn_bf16(float* C, int ldc, const float* A, int lda,
                                   const unsigned short* B, int ldb, int n, int k,
                                   int accumulate) {
    product_nn<true, BF16>(C, ldc, A, lda, B, ldb, n, k, accumulate);
}

__device__ float tfmath_f16_to_float(unsigned short x) { return F16::to_float(x); }

__device__ float tfmath_bf16_to_float(unsigned short x) { return BF16::to_float(x); }

}  // extern "C"
