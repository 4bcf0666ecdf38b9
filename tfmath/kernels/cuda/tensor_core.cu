// FlashAttention-2's forward and backward on the tensor cores, for tfmath's
// half-precision attention (tfmath/kernels/cuda/tensor_core.py calls them from Numba
// kernels, linked with numba-cuda's `link=` and compiled by NVRTC; under
// TFMATH_WARP_EMULATOR, tfmath/tools/warp_emulator.h runs them on the CPU). The
// backward's design is at flash_backward_query, below; the forward's:
//
// One block of WARPS warps (4 or 8; the Python side picks per head size) takes
// 16 query rows per warp against tiles of BC = 64 keys (Dao 2023,
// "FlashAttention-2", Algorithm 1 and its section 3.3 on splitting the work
// between warps):
//  - Q, K and V tiles reach shared memory by asynchronous copies (cp.async, 16
//    bytes per thread per copy). Q passes through the K and V tiles once, at the
//    start. The next tile's keys are copied while the block multiplies the
//    current values, and the values while it computes the scores, so a tile's
//    loads overlap the other product.
//  - Fragments leave shared memory by `ldmatrix` (eight 16-byte rows per warp
//    and matrix). Tiles are stored swizzled: the 16-byte chunk c of row r sits
//    at chunk c ^ (r % 8), so the eight rows of one `ldmatrix` and the eight
//    chunks of one row of copies hit distinct banks without padding.
//  - Products are `mma.sync.aligned.m16n8k16`: 16-bit operands, float32
//    accumulators. A warp holds its Q fragments, its 16 x 64 scores and its
//    16 x D output in registers for the whole key loop; the scores, after the
//    softmax, are rounded to the operands' format in registers and become the
//    A operand of the P V product directly (the accumulator layout of
//    m16n8k16 is the A-operand layout of the next product).
//  - The online softmax runs on every thread: a row's 64 scores are spread
//    over a quad of four threads (two rows per thread), whose maximum is
//    agreed with two shuffles; each thread keeps a partial normaliser, summed
//    over the quad once, at the end.
//  - The output is normalised and rounded to the operands' format in
//    registers, and stored two numbers at a time; the log-sum-exp stays float32.
//  - Under a causal mask, key tiles wholly above the diagonal are never read.
//  - Masked positions (causal, beyond the keys, a -inf bias) get weight
//    exactly 0 and their values are never multiplied in: a value tile that
//    holds a non-finite number takes a slower loop that skips zero weights,
//    since 0 * inf is NaN on the tensor cores too. Only tiles with a masked
//    position are scanned for such numbers (beyond the keys, the copies
//    write zeros).
// Head sizes D = 64 and 128 (the swizzle needs 8 or 16 chunks a row); the
// shared memory, at most 48 KiB, is static.

#ifndef TFMATH_WARP_EMULATOR
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace {

constexpr int BC = 64;  // keys per tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// -inf without math.h, which NVRTC lacks.
#define NEG_INF __int_as_float(0xff800000)

struct F16 {
    static constexpr bool WIDE = false;  // 16-bit operands
    static __device__ unsigned pack(float low, float high) {
        __half2 h = __floats2half2_rn(low, high);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ float to_float(unsigned short x) {
        return __half2float(__ushort_as_half(x));
    }
    static constexpr unsigned short EXPONENT = 0x7C00;
};

struct BF16 {
    static constexpr bool WIDE = false;
    static __device__ unsigned pack(float low, float high) {
        __nv_bfloat162 h = __floats2bfloat162_rn(low, high);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ float to_float(unsigned short x) {
        return __bfloat162float(__ushort_as_bfloat16(x));
    }
    static constexpr unsigned short EXPONENT = 0x7F80;
};

// TF32: float32 operands in memory, multiplied on the tensor cores (m16n8k8) with
// 10 bits of significand, as float16 has, and float32's range; each operand is
// rounded to that (to nearest, ties away from zero: cvt.rna) in registers. Heads of
// 64, opt-in (TFMATH_CUDA_TF32=1): its error is float16's, not float32's
// (docs/backends.rst). A float32 row of D numbers is a tile row of 2 D
// 16-bit words, so the tiles, their swizzle, the copies and the `ldmatrix` loads of
// Q and K are the 16-bit formats' at twice the width: an 8 x 8 matrix of 16-bit
// words is an 8 x 4 matrix of float32, and the four of `ldmatrix.x4` are the
// m16n8k8 A fragment (or two B fragments) exactly.
struct TF32 {
    static constexpr bool WIDE = true;
};

// The instructions of the tensor cores and asynchronous copies, in PTX; under
// TFMATH_WARP_EMULATOR, their host emulation (tfmath/tools/warp_emulator.h).
#ifdef TFMATH_WARP_EMULATOR
template <class T>
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], unsigned b0,
                                          unsigned b1) {
    warp_emulator::mma_16816<T>(c, a, b0, b1);
}
__device__ __forceinline__ void copy_async(void* shared, const void* global, bool valid) {
    warp_emulator::copy_async(shared, global, valid);
}
__device__ __forceinline__ void commit_copies() { warp_emulator::commit_copies(); }
__device__ __forceinline__ void wait_copies() { warp_emulator::wait_copies(); }
__device__ __forceinline__ void load_matrix_x4(unsigned r[4], const void* p) {
    warp_emulator::load_matrix_x4(r, p, false);
}
__device__ __forceinline__ void load_matrix_x4_transposed(unsigned r[4], const void* p) {
    warp_emulator::load_matrix_x4(r, p, true);
}
__device__ __forceinline__ void mma_1688_tf32(float c[4], const unsigned a[4], unsigned b0,
                                              unsigned b1) {
    warp_emulator::mma_1688_tf32(c, a, b0, b1);
}
__device__ __forceinline__ unsigned to_tf32(float x) { return warp_emulator::tf32_bits(x); }
#else
template <class T>
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], unsigned b0,
                                          unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<F16>(float c[4], const unsigned a[4], unsigned b0,
                                               unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<BF16>(float c[4], const unsigned a[4], unsigned b0,
                                                unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_1688_tf32(float c[4], const unsigned a[4], unsigned b0,
                                              unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// float32 -> TF32, to nearest, ties away from zero (the bits of a float32).
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned bits;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(bits) : "f"(x));
    return bits;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global to shared memory without the registers; with
// `valid` false it writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void copy_async(void* shared, const void* global, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
                 "l"(global), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void load_matrix_x4(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

__device__ __forceinline__ void load_matrix_x4_transposed(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

#endif

// Offset, in 16-bit numbers, of chunk `chunk` (8 numbers) of row `row` in a
// swizzled tile of D numbers a row.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) << 3);
}

// The fragments a warp multiplies, loaded from swizzled tiles of D numbers a row
// (lane is the thread's index in its warp):
//  - the A operand of rows [row, row + 16) and columns [16 k, 16 k + 16) of a tile
//    (queries against features, say);
//  - the B operands, columns j and j + 1 of eight, of a product with a tile's rows
//    as its columns (B = tile^T: keys as the scores' columns, features as their
//    inner dimension), inner step k;
//  - the B operands, columns j and j + 1 of eight, of a product with a tile as it
//    is (B = tile: keys as the inner dimension of P V, features as its columns),
//    inner step k.
template <int D>
__device__ __forceinline__ void load_rows_fragment(unsigned a[4], const unsigned short* tile,
                                                   int row, int k, int lane) {
    load_matrix_x4(a, tile + swizzled<D>(row + (lane & 15), 2 * k + (lane >> 4)));
}

template <int D>
__device__ __forceinline__ void load_transposed_operand(unsigned b[4], const unsigned short* tile,
                                                        int j, int k, int lane) {
    load_matrix_x4(b, tile + swizzled<D>(8 * j + (lane & 7) + ((lane >> 4) << 3),
                                         2 * k + ((lane >> 3) & 1)));
}

template <int D>
__device__ __forceinline__ void load_operand(unsigned b[4], const unsigned short* tile, int j,
                                             int k, int lane) {
    load_matrix_x4_transposed(
        b, tile + swizzled<D>(16 * k + (lane & 7) + (((lane >> 3) & 1) << 3), j + (lane >> 4)));
}

// Float32 accumulators of a warp's 16 x (8 NT) product, rounded to the operands'
// format in registers as the A fragments of the next product over those 8 NT
// columns (the accumulator layout of m16n8k16 is the A-operand layout).
template <class T, int NT>
__device__ __forceinline__ void round_to_fragments(unsigned frag[NT / 2][4], const float c[NT][4]) {
    #pragma unroll
    for (int k = 0; k < NT / 2; ++k) {
        frag[k][0] = T::pack(c[2 * k][0], c[2 * k][1]);
        frag[k][1] = T::pack(c[2 * k][2], c[2 * k][3]);
        frag[k][2] = T::pack(c[2 * k + 1][0], c[2 * k + 1][1]);
        frag[k][3] = T::pack(c[2 * k + 1][2], c[2 * k + 1][3]);
    }
}

// The products of format T, and its operands as loaded (defined below: TF32 rounds).
template <class T>
__device__ __forceinline__ void multiply(float c[4], const unsigned a[4], unsigned b0,
                                         unsigned b1);
template <class T, int N>
__device__ __forceinline__ void as_operands(unsigned r[N]);

// c (16 x 8 NT) += a (16 x W words, A fragments from `a_tile` rows [row, row + 16))
// times b_tile^T (b_tile's first 8 NT rows, W 16-bit words each: W numbers, or W / 2
// float32 for TF32).
template <class T, int W, int NT>
__device__ __forceinline__ void add_product_transposed(float c[NT][4],
                                                       const unsigned short* a_tile, int row,
                                                       const unsigned short* b_tile, int lane) {
    #pragma unroll
    for (int k = 0; k < W / 16; ++k) {
        unsigned a[4];
        load_rows_fragment<W>(a, a_tile, row, k, lane);
        as_operands<T, 4>(a);
        #pragma unroll
        for (int j = 0; j < NT; j += 2) {
            unsigned b[4];
            load_transposed_operand<W>(b, b_tile, j, k, lane);
            as_operands<T, 4>(b);
            multiply<T>(c[j], a, b[0], b[1]);
            multiply<T>(c[j + 1], a, b[2], b[3]);
        }
    }
}

// c (16 x D) += the rounded fragments (16 x 16 KS) times b_tile's first 16 KS rows.
template <class T, int D, int KS>
__device__ __forceinline__ void add_product(float c[D / 8][4], const unsigned frag[KS][4],
                                            const unsigned short* b_tile, int lane) {
    #pragma unroll
    for (int k = 0; k < KS; ++k) {
        #pragma unroll
        for (int j = 0; j < D / 8; j += 2) {
            unsigned b[4];
            load_operand<D>(b, b_tile, j, k, lane);
            mma_16816<T>(c[j], frag[k], b[0], b[1]);
            mma_16816<T>(c[j + 1], frag[k], b[2], b[3]);
        }
    }
}

// The product of format T: m16n8k16 on 16-bit operands, m16n8k8 on TF32 ones (the
// same registers hold 16 x 16 16-bit words or 16 x 8 float32).
template <class T>
__device__ __forceinline__ void multiply(float c[4], const unsigned a[4], unsigned b0,
                                         unsigned b1) {
    if constexpr (T::WIDE)
        mma_1688_tf32(c, a, b0, b1);
    else
        mma_16816<T>(c, a, b0, b1);
}

// Operands loaded as float32, rounded to TF32 in place (16-bit formats: nothing).
template <class T, int N>
__device__ __forceinline__ void as_operands(unsigned r[N]) {
    if constexpr (T::WIDE) {
        #pragma unroll
        for (int i = 0; i < N; ++i) r[i] = to_tf32(__uint_as_float(r[i]));
    }
}

// The weights of a warp's 16 x (8 NT) scores as TF32 A fragments of P V, one per 8
// keys. A k8 fragment holds inner columns t and t + 4 of its thread's rows, the
// accumulators columns 2t and 2t + 1: so P V takes each 8 keys in the order 0, 2, 4,
// 6, 1, 3, 5, 7 (key 2t as inner index t, key 2t + 1 as t + 4), add_product_tf32
// reads the value rows in that order, and no shuffle is needed.
template <int NT>
__device__ __forceinline__ void weights_to_tf32(unsigned frag[NT][4], const float c[NT][4]) {
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
        frag[j][0] = to_tf32(c[j][0]);
        frag[j][1] = to_tf32(c[j][2]);
        frag[j][2] = to_tf32(c[j][1]);
        frag[j][3] = to_tf32(c[j][3]);
    }
}

// The float32 number at row `row`, feature f of a swizzled tile of D float32 a row
// (2 D 16-bit words).
template <int D>
__device__ __forceinline__ float wide_at(const unsigned short* tile, int row, int f) {
    return *reinterpret_cast<const float*>(tile + swizzled<2 * D>(row, f >> 2) + 2 * (f & 3));
}

// c (16 x D) += the TF32 weights (16 x 8 KS, keys ordered as weights_to_tf32 says)
// times the value tile's first 8 KS rows, read one float32 a thread and rounded.
template <int D, int KS>
__device__ __forceinline__ void add_product_tf32(float c[D / 8][4], const unsigned frag[KS][4],
                                                 const unsigned short* v_tile, int lane) {
    const int g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int k = 0; k < KS; ++k) {
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const unsigned b0 = to_tf32(wide_at<D>(v_tile, 8 * k + 2 * t, 8 * j + g));
            const unsigned b1 = to_tf32(wide_at<D>(v_tile, 8 * k + 2 * t + 1, 8 * j + g));
            mma_1688_tf32(c[j], frag[k], b0, b1);
        }
    }
}

// 16-bit words a row of D numbers of format T takes, in memory and in the tiles.
template <class T, int D>
constexpr int row_words = T::WIDE ? 2 * D : D;

// Steps of a product's inner dimension over NKEYS weights (16 keys a step, or 8 for
// TF32), and so the weights' fragments.
template <class T, int NKEYS>
constexpr int weight_steps = T::WIDE ? NKEYS / 8 : NKEYS / 16;

// Float32 accumulators of a warp's 16 x (8 NT) product as the A fragments of the next
// product over those columns, in format T.
template <class T, int NT>
__device__ __forceinline__ void to_fragments(unsigned frag[weight_steps<T, 8 * NT>][4],
                                             const float c[NT][4]) {
    if constexpr (T::WIDE)
        weights_to_tf32<NT>(frag, c);
    else
        round_to_fragments<T, NT>(frag, c);
}

// c (16 x D) += the fragments (16 x 8 NT weights) times b_tile's first 8 NT rows of D
// numbers.
template <class T, int D, int NT>
__device__ __forceinline__ void add_weighted(float c[D / 8][4],
                                             const unsigned frag[weight_steps<T, 8 * NT>][4],
                                             const unsigned short* b_tile, int lane) {
    if constexpr (T::WIDE)
        add_product_tf32<D, weight_steps<T, 8 * NT>>(c, frag, b_tile, lane);
    else
        add_product<T, D, weight_steps<T, 8 * NT>>(c, frag, b_tile, lane);
}

// Entry e of 8-column tile j of a warp's weights, from their fragments (16-bit
// formats: two a register, per round_to_fragments; TF32: one, per weights_to_tf32),
// stored at `weights[i]` in format T, and read back as a float.
template <class T, int KS>
__device__ __forceinline__ void store_weight(unsigned short* weights, int i,
                                             const unsigned frag[KS][4], int j, int e) {
    if constexpr (T::WIDE)
        reinterpret_cast<unsigned*>(weights)[i] = frag[j][(e >> 1) + 2 * (e & 1)];
    else
        weights[i] = static_cast<unsigned short>(frag[j >> 1][2 * (j & 1) + (e >> 1)] >>
                                                 (16 * (e & 1)));
}

template <class T>
__device__ __forceinline__ float weight_at(const unsigned short* weights, int i) {
    if constexpr (T::WIDE)
        return reinterpret_cast<const float*>(weights)[i];
    else
        return T::to_float(weights[i]);
}

// Number f of row `row` of a swizzled tile of D numbers a row, as its products read
// it (TF32: rounded).
template <class T, int D>
__device__ __forceinline__ float operand_at(const unsigned short* tile, int row, int f) {
    if constexpr (T::WIDE)
        return __uint_as_float(to_tf32(wide_at<D>(tile, row, f)));
    else
        return T::to_float(tile[swizzled<D>(row, f >> 3) + (f & 7)]);
}

// Number f of a row of an operand in memory (16-bit, or float32 for TF32).
template <class T>
__device__ __forceinline__ float number_at(const unsigned short* row, int f) {
    if constexpr (T::WIDE)
        return reinterpret_cast<const float*>(row)[f];
    else
        return T::to_float(row[f]);
}

// Copies rows [first, first + ROWS) of a row-major (n_rows x D) matrix into a
// swizzled tile; rows past n_rows become zeros.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void copy_tile(unsigned short* tile, const unsigned short* matrix,
                                          int first, int n_rows) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int row = i / CHUNKS, chunk = i % CHUNKS;
        bool valid = first + row < n_rows;
        const unsigned short* source = matrix + (valid ? (long long)(first + row) * D : 0);
        copy_async(tile + swizzled<D>(row, chunk), source + chunk * 8, valid);
    }
}

// Whether a number (16-bit, or float32 for TF32) in the chunks this thread copied
// into a tile of D 16-bit words a row is inf or NaN.
template <class T, int D, int THREADS>
__device__ __forceinline__ bool copied_non_finite(const unsigned short* tile) {
    constexpr int CHUNKS = D / 8;
    bool found = false;
    for (int i = threadIdx.x; i < BC * CHUNKS; i += THREADS) {
        const uint4 bits =
            *reinterpret_cast<const uint4*>(tile + swizzled<D>(i / CHUNKS, i % CHUNKS));
        const unsigned words[4] = {bits.x, bits.y, bits.z, bits.w};
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            if constexpr (T::WIDE) {
                found |= (words[w] & 0x7F800000u) == 0x7F800000u;
            } else {
                found |= (words[w] & T::EXPONENT) == T::EXPONENT;
                found |= ((words[w] >> 16) & T::EXPONENT) == T::EXPONENT;
            }
        }
    }
    return found;
}

template <class T, int D, int WARPS>
__device__ void flash_forward(const unsigned short* query, const unsigned short* key,
                              const unsigned short* value, const float* bias, int has_bias,
                              int n_query, int n_key, int is_causal, float scale, int row_tile,
                              unsigned short* out, float* log_sum_exp) {
    constexpr int W = row_words<T, D>;  // 16-bit words a row of the operands
    constexpr int KSTEPS = W / 16;  // steps of the scores' inner dimension (16 words each)
    constexpr int NTILES = BC / 8;  // 8-key column tiles of the scores
    constexpr int OTILES = D / 8;   // 8-feature column tiles of the output
    constexpr int THREADS = 32 * WARPS, BR = 16 * WARPS;
    static_assert(BR <= 2 * BC, "the Q tile passes through the K and V tiles");
    // The K and V tiles, and first the Q tile, whose fragments then stay in registers.
    __shared__ __align__(128) unsigned short kv_tile[2 * BC * W];
    // The rounded weights of a value tile that needs the careful loop, each warp its rows.
    __shared__ __align__(128) unsigned short weight_tile[BR * BC * (T::WIDE ? 2 : 1)];
    unsigned short* const q_tile = kv_tile;
    unsigned short* const k_tile = kv_tile;
    unsigned short* const v_tile = kv_tile + BC * W;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_row = row_tile * BR;
    const int warp_row = first_row + warp * 16;
    // This thread's two rows (g and g + 8 of the warp's 16) and its column pair.
    const int row0 = warp_row + (lane >> 2), row1 = row0 + 8;
    const int pair = 2 * (lane & 3);
    const float scale_log2 = scale * LOG2E;

    const int key_end = is_causal ? min(n_key, first_row + BR) : n_key;
    const int n_tiles = (key_end + BC - 1) / BC;

    copy_tile<W, BR, THREADS>(q_tile, query, first_row, n_query);
    commit_copies();
    wait_copies();
    __syncthreads();

    unsigned q_frag[KSTEPS][4];
    #pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
        load_rows_fragment<W>(q_frag[k], q_tile, warp * 16, k, lane);
        as_operands<T, 4>(q_frag[k]);
    }
    // Every warp holds its fragments before the first key tile overwrites Q's.
    __syncthreads();
    copy_tile<W, BC, THREADS>(k_tile, key, 0, n_key);
    commit_copies();

    float acc[OTILES][4];
    #pragma unroll
    for (int j = 0; j < OTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float row_max[2] = {NEG_INF, NEG_INF};
    float row_sum[2] = {0.f, 0.f};

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int start = tile * BC;
        // The key tile has landed; every warp is done with the last value tile.
        wait_copies();
        __syncthreads();
        copy_tile<W, BC, THREADS>(v_tile, value, start, n_key);
        commit_copies();

        float s[NTILES][4];
        #pragma unroll
        for (int j = 0; j < NTILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        #pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            #pragma unroll
            for (int j = 0; j < NTILES; j += 2) {
                unsigned b[4];
                load_transposed_operand<W>(b, k_tile, j, k, lane);
                as_operands<T, 4>(b);
                multiply<T>(s[j], q_frag[k], b[0], b[1]);
                multiply<T>(s[j + 1], q_frag[k], b[2], b[3]);
            }
        }

        // Scores in base 2, masked positions at -inf.
        const bool edge = has_bias || start + BC > n_key || (is_causal && start + BC - 1 > warp_row);
        #pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[j][e] * scale_log2;
                if (edge) {
                    const int row = e < 2 ? row0 : row1;
                    const int col = start + 8 * j + pair + (e & 1);
                    if (col >= n_key || (is_causal && col > row)) {
                        x = NEG_INF;
                    } else if (has_bias && row < n_query) {
                        const float b = bias[(long long)row * n_key + col];
                        x = b == NEG_INF ? NEG_INF : x + b * LOG2E;
                    }
                }
                s[j][e] = x;
            }
        }

        // The online softmax, rows row0 (entries 0, 1) and row1 (entries 2, 3).
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float tile_max = NEG_INF;
            #pragma unroll
            for (int j = 0; j < NTILES; ++j)
                tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[r], tile_max);
            // A row with nothing visible yet keeps weight 0 everywhere.
            const float base = new_max == NEG_INF ? 0.f : new_max;
            const float factor = exp2f(row_max[r] - base);
            row_max[r] = new_max;
            float total = 0.f;
            #pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                s[j][2 * r] = exp2f(s[j][2 * r] - base);
                s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - base);
                total += s[j][2 * r] + s[j][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * factor + total;
            #pragma unroll
            for (int j = 0; j < OTILES; ++j) {
                acc[j][2 * r] *= factor;
                acc[j][2 * r + 1] *= factor;
            }
        }

        // The weights, rounded to the operands' format: the A fragments of P V.
        unsigned p_frag[weight_steps<T, BC>][4];
        to_fragments<T, NTILES>(p_frag, s);

        // The value tile has landed; every warp is done with the key tile. Only a tile
        // with a masked position can pair a weight of 0 with inf or NaN: elsewhere every
        // weight is positive (one that underflows to 0 belongs to a row whose exact
        // output is already inf or NaN), so the scan is skipped. The condition is the
        // same on every thread of the block, as the barriers need.
        wait_copies();
        const bool may_mask = has_bias || (is_causal && start + BC - 1 > first_row);
        bool careful = false;
        if (may_mask)
            careful = __syncthreads_or(copied_non_finite<T, W, THREADS>(v_tile));
        else
            __syncthreads();
        if (tile + 1 < n_tiles) copy_tile<W, BC, THREADS>(k_tile, key, start + BC, n_key);
        commit_copies();

        if (!careful) {
            add_weighted<T, D, NTILES>(acc, p_frag, v_tile, lane);
        } else {
            // The rounded weights through shared memory (each warp its 16 rows),
            // then every output entry of this thread summed over the keys whose
            // weight is not 0.
            unsigned short* weights = weight_tile + warp * 16 * BC * (T::WIDE ? 2 : 1);
            #pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    store_weight<T, weight_steps<T, BC>>(
                        weights, ((lane >> 2) + 8 * (e >> 1)) * BC + 8 * j + pair + (e & 1),
                        p_frag, j, e);
            }
            __syncwarp();
            #pragma unroll
            for (int j = 0; j < OTILES; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = (lane >> 2) + 8 * (e >> 1), f = 8 * j + pair + (e & 1);
                    float sum = acc[j][e];
                    #pragma unroll 4
                    for (int t = 0; t < BC; ++t) {
                        const float p = weight_at<T>(weights, r * BC + t);
                        if (p != 0.f) sum += p * operand_at<T, D>(v_tile, t, f);
                    }
                    acc[j][e] = sum;
                }
            }
            __syncwarp();
        }
    }

    // The normalisers, summed over the quad; a row that sees no key gets 0 and -inf.
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = r == 0 ? row0 : row1;
        if (row >= n_query) continue;
        const bool empty = total == 0.f;
        const float inverse = empty ? 0.f : 1.f / total;
        if constexpr (T::WIDE) {
            // float32 out, two numbers an 8-byte store.
            float2* out_row = reinterpret_cast<float2*>(out + (long long)row * W);
            #pragma unroll
            for (int j = 0; j < OTILES; ++j)
                out_row[(8 * j + pair) / 2] =
                    make_float2(acc[j][2 * r] * inverse, acc[j][2 * r + 1] * inverse);
        } else {
            // Rounded to the operands' format here, two numbers a 4-byte store.
            unsigned* out_row = reinterpret_cast<unsigned*>(out + (long long)row * D);
            #pragma unroll
            for (int j = 0; j < OTILES; ++j)
                out_row[(8 * j + pair) / 2] =
                    T::pack(acc[j][2 * r] * inverse, acc[j][2 * r + 1] * inverse);
        }
        if (log_sum_exp != nullptr && (lane & 3) == 0)
            log_sum_exp[row] = empty ? NEG_INF : (row_max[r] + log2f(total)) * LN2;
    }
}

// FlashAttention-2's backward (Dao 2023, Algorithm 2), in two kernels that never add
// into the same number, so that every run gives the same bits: this one computes
// dQ over the key tiles (and D_i = dO_i . O_i, which the other reads), the next dK
// and dV over the query tiles. Each recomputes the scores it needs from the saved
// log-sum-exp, P = exp(s S + M - lse). P and dS = P (dP - D) are rounded to the
// operands' format before their products, as FlashAttention-2 does; every sum is
// float32, and so are the gradients written (the caller rounds them once, after
// summing broadcast heads). The operands must be finite (the caller checks): a 0 in
// P or dS times an inf in a tile is NaN on the tensor cores.
//
// One block of WARPS warps takes 16 x WARPS query rows; each warp, its 16 rows
// against tiles of BC keys. The block's Q and dO rows stay in shared memory, whole,
// for the key loop; K and V tiles arrive by asynchronous copies, the next V tile
// while dS and dQ's product are computed, the next K tile while the next scores wait.
template <class T, int D, int WARPS, int BC>
__device__ void flash_backward_query(const unsigned short* query, const unsigned short* key,
                                     const unsigned short* value, const unsigned short* out,
                                     const unsigned short* grad_out, const float* log_sum_exp,
                                     const float* bias, int has_bias, int n_query, int n_key,
                                     int is_causal, float scale, int row_tile, float* grad_query,
                                     float* delta) {
    constexpr int W = row_words<T, D>;  // 16-bit words a row of the operands
    constexpr int NTILES = BC / 8, OTILES = D / 8;
    constexpr int THREADS = 32 * WARPS, BR = 16 * WARPS;
    __shared__ __align__(128) unsigned short q_tile[BR * W];
    __shared__ __align__(128) unsigned short g_tile[BR * W];
    __shared__ __align__(128) unsigned short k_tile[BC * W];
    __shared__ __align__(128) unsigned short v_tile[BC * W];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_row = row_tile * BR;
    const int warp_row = first_row + warp * 16;
    const int row0 = warp_row + (lane >> 2), row1 = row0 + 8;
    const int pair = 2 * (lane & 3);
    const float scale_log2 = scale * LOG2E;
    const int key_end = is_causal ? min(n_key, first_row + BR) : n_key;
    const int n_tiles = (key_end + BC - 1) / BC;

    copy_tile<W, BR, THREADS>(q_tile, query, first_row, n_query);
    copy_tile<W, BR, THREADS>(g_tile, grad_out, first_row, n_query);
    copy_tile<W, BC, THREADS>(k_tile, key, 0, n_key);
    copy_tile<W, BC, THREADS>(v_tile, value, 0, n_key);
    commit_copies();

    // D_i and the log-sum-exp in base 2 of this thread's two rows; a row past the
    // queries, or one that sees no key (lse = -inf), gets P = 0.
    float row_delta[2], row_lse[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row0 : row1;
        float sum = 0.f;
        if (row < n_query) {
            const unsigned short* o = out + (long long)row * W;
            const unsigned short* g = grad_out + (long long)row * W;
            #pragma unroll
            for (int j = 0; j < OTILES; ++j) {
                const int f = 8 * j + pair;
                sum += number_at<T>(o, f) * number_at<T>(g, f) +
                       number_at<T>(o, f + 1) * number_at<T>(g, f + 1);
            }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        row_delta[r] = sum;
        row_lse[r] = row < n_query ? log_sum_exp[row] * LOG2E : NEG_INF;
        if (row < n_query && (lane & 3) == 0) delta[row] = sum;
    }

    float acc[OTILES][4];
    #pragma unroll
    for (int j = 0; j < OTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int start = tile * BC;
        // This tile's keys and values have landed (the first time, Q and dO too).
        wait_copies();
        __syncthreads();

        float s[NTILES][4], dp[NTILES][4];
        #pragma unroll
        for (int j = 0; j < NTILES; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        add_product_transposed<T, W, NTILES>(s, q_tile, warp * 16, k_tile, lane);
        add_product_transposed<T, W, NTILES>(dp, g_tile, warp * 16, v_tile, lane);

        // Every warp is done with the values: the next tile's are copied meanwhile.
        __syncthreads();
        if (tile + 1 < n_tiles) copy_tile<W, BC, THREADS>(v_tile, value, start + BC, n_key);
        commit_copies();

        // dS = P (dP - D), in s.
        const bool edge = has_bias || start + BC > n_key || (is_causal && start + BC - 1 > warp_row);
        #pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int row = r == 0 ? row0 : row1;
                const int col = start + 8 * j + pair + (e & 1);
                float x = s[j][e] * scale_log2;
                if (edge) {
                    if (col >= n_key || (is_causal && col > row)) {
                        x = NEG_INF;
                    } else if (has_bias && row < n_query) {
                        const float b = bias[(long long)row * n_key + col];
                        x = b == NEG_INF ? NEG_INF : x + b * LOG2E;
                    }
                }
                const float p = row_lse[r] == NEG_INF ? 0.f : exp2f(x - row_lse[r]);
                s[j][e] = p == 0.f ? 0.f : p * (dp[j][e] - row_delta[r]);
            }
        }

        // dQ += dS K, dS rounded to the operands' format.
        unsigned ds_frag[weight_steps<T, BC>][4];
        to_fragments<T, NTILES>(ds_frag, s);
        add_weighted<T, D, NTILES>(acc, ds_frag, k_tile, lane);

        // Every warp is done with the keys.
        __syncthreads();
        if (tile + 1 < n_tiles) copy_tile<W, BC, THREADS>(k_tile, key, start + BC, n_key);
        commit_copies();
    }

    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row0 : row1;
        if (row >= n_query) continue;
        float* grad_row = grad_query + (long long)row * D;
        #pragma unroll
        for (int j = 0; j < OTILES; ++j) {
            grad_row[8 * j + pair] = scale * acc[j][2 * r];
            grad_row[8 * j + pair + 1] = scale * acc[j][2 * r + 1];
        }
    }
}

// The backward's second kernel: dK and dV of 16 x WARPS keys a block, each warp 16
// keys against tiles of BQ queries, S^T = K Q^T and dP^T = V dO^T computed with the
// keys as rows, so that P^T and dS^T are the A operands of dV += P^T dO and
// dK += dS^T Q. The block's K and V rows stay in shared memory; Q and dO tiles
// arrive by asynchronous copies. Under a causal mask, query tiles wholly before the
// block's first key are never read. Reads the D_i the first kernel wrote.
template <class T, int D, int WARPS, int BQ>
__device__ void flash_backward_key(const unsigned short* query, const unsigned short* key,
                                   const unsigned short* value, const unsigned short* grad_out,
                                   const float* log_sum_exp, const float* delta,
                                   const float* bias, int has_bias, int n_query, int n_key,
                                   int is_causal, float scale, int key_tile, float* grad_key,
                                   float* grad_value) {
    constexpr int W = row_words<T, D>;  // 16-bit words a row of the operands
    constexpr int NTILES = BQ / 8, OTILES = D / 8;
    constexpr int THREADS = 32 * WARPS, BK = 16 * WARPS;
    __shared__ __align__(128) unsigned short k_tile[BK * W];
    __shared__ __align__(128) unsigned short v_tile[BK * W];
    __shared__ __align__(128) unsigned short q_tile[BQ * W];
    __shared__ __align__(128) unsigned short g_tile[BQ * W];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_key = key_tile * BK;
    const int warp_key = first_key + warp * 16;
    const int key0 = warp_key + (lane >> 2), key1 = key0 + 8;
    const int pair = 2 * (lane & 3);
    const float scale_log2 = scale * LOG2E;
    // Under a causal mask query i sees keys j <= i: tiles before the first key see none.
    const int first_tile = is_causal ? first_key / BQ : 0;
    const int n_tiles = (n_query + BQ - 1) / BQ;

    copy_tile<W, BK, THREADS>(k_tile, key, first_key, n_key);
    copy_tile<W, BK, THREADS>(v_tile, value, first_key, n_key);
    copy_tile<W, BQ, THREADS>(q_tile, query, first_tile * BQ, n_query);
    copy_tile<W, BQ, THREADS>(g_tile, grad_out, first_tile * BQ, n_query);
    commit_copies();

    float acc_k[OTILES][4], acc_v[OTILES][4];
    #pragma unroll
    for (int j = 0; j < OTILES; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[j][e] = acc_v[j][e] = 0.f;

    for (int tile = first_tile; tile < n_tiles; ++tile) {
        const int start = tile * BQ;
        wait_copies();
        __syncthreads();

        float s[NTILES][4], dp[NTILES][4];
        #pragma unroll
        for (int j = 0; j < NTILES; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        add_product_transposed<T, W, NTILES>(s, k_tile, warp * 16, q_tile, lane);
        add_product_transposed<T, W, NTILES>(dp, v_tile, warp * 16, g_tile, lane);

        // P^T in s and dS^T in dp; this thread's columns are queries
        // start + 8 j + pair (+ 1), its rows keys key0 and key1.
        const bool edge = has_bias || start + BQ > n_query || (is_causal && warp_key + 15 > start);
        #pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = start + 8 * j + pair + c;
                const bool query_valid = col < n_query;
                const float col_lse = query_valid ? log_sum_exp[col] * LOG2E : NEG_INF;
                const float col_delta = query_valid ? delta[col] : 0.f;
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int e = 2 * r + c;
                    const int row = r == 0 ? key0 : key1;
                    float x = s[j][e] * scale_log2;
                    if (edge) {
                        if (is_causal && row > col) {
                            x = NEG_INF;
                        } else if (has_bias && query_valid && row < n_key) {
                            const float b = bias[(long long)col * n_key + row];
                            x = b == NEG_INF ? NEG_INF : x + b * LOG2E;
                        }
                    }
                    const float p = col_lse == NEG_INF ? 0.f : exp2f(x - col_lse);
                    s[j][e] = p;
                    dp[j][e] = p == 0.f ? 0.f : p * (dp[j][e] - col_delta);
                }
            }
        }

        // dV += P^T dO and dK += dS^T Q, P and dS rounded to the operands' format.
        unsigned frag[weight_steps<T, BQ>][4];
        to_fragments<T, NTILES>(frag, s);
        add_weighted<T, D, NTILES>(acc_v, frag, g_tile, lane);
        to_fragments<T, NTILES>(frag, dp);
        add_weighted<T, D, NTILES>(acc_k, frag, q_tile, lane);

        // Every warp is done with this tile's queries.
        __syncthreads();
        if (tile + 1 < n_tiles) {
            copy_tile<W, BQ, THREADS>(q_tile, query, start + BQ, n_query);
            copy_tile<W, BQ, THREADS>(g_tile, grad_out, start + BQ, n_query);
        }
        commit_copies();
    }

    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? key0 : key1;
        if (row >= n_key) continue;
        float* grad_k = grad_key + (long long)row * D;
        float* grad_v = grad_value + (long long)row * D;
        #pragma unroll
        for (int j = 0; j < OTILES; ++j) {
            grad_k[8 * j + pair] = scale * acc_k[j][2 * r];
            grad_k[8 * j + pair + 1] = scale * acc_k[j][2 * r + 1];
            grad_v[8 * j + pair] = acc_v[j][2 * r];
            grad_v[8 * j + pair + 1] = acc_v[j][2 * r + 1];
        }
    }
}

}  // namespace

// The entry points, one per format, head size and warps per block: Numba calls them
// with the C ABI, each operand as the device address of its batch entry's first row
// (integers, which Numba passes as they are; no output's log-sum-exp when 0).
#define TFMATH_FLASH_FORWARD(T, SUFFIX, D, WARPS)                                            \
    extern "C" __device__ void tfmath_flash_forward_##SUFFIX##_##D##_w##WARPS(               \
        long long query, long long key, long long value, long long bias, int has_bias,      \
        int n_query, int n_key, int is_causal, float scale, int row_tile, long long out,     \
        long long log_sum_exp) {                                                             \
        flash_forward<T, D, WARPS>(                                                          \
            reinterpret_cast<const unsigned short*>(query),                                  \
            reinterpret_cast<const unsigned short*>(key),                                    \
            reinterpret_cast<const unsigned short*>(value),                                  \
            reinterpret_cast<const float*>(bias), has_bias, n_query, n_key, is_causal,       \
            scale, row_tile, reinterpret_cast<unsigned short*>(out),                         \
            reinterpret_cast<float*>(log_sum_exp));                                          \
    }                                                                                        \
    TFMATH_CHECK_KERNEL(SUFFIX##_##D##_w##WARPS, WARPS)

#ifdef TFMATH_RESOURCE_CHECK
// Kernels that only call an entry point, so that ptxas reports each one's registers,
// spills and shared memory (tfmath.tools.ptx compiles them).
#define TFMATH_CHECK_KERNEL(NAME, WARPS)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) tfmath_flash_forward_##NAME##_kernel( \
        const unsigned short* q, const unsigned short* k, const unsigned short* v,          \
        const float* bias, int has_bias, int n_query, int n_key, int is_causal, float scale, \
        unsigned short* out, float* lse) {                                                   \
        tfmath_flash_forward_##NAME((long long)q, (long long)k, (long long)v,               \
                                    (long long)bias, has_bias, n_query, n_key, is_causal,    \
                                    scale, blockIdx.x, (long long)out, (long long)lse);      \
    }
#define TFMATH_CHECK_BACKWARD_KERNELS(NAME, WARPS)                                           \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                 \
        tfmath_flash_backward_query_##NAME##_kernel(                                         \
            const unsigned short* q, const unsigned short* k, const unsigned short* v,      \
            const unsigned short* o, const unsigned short* g, const float* lse,             \
            const float* bias, int has_bias, int n_query, int n_key, int is_causal,         \
            float scale, float* grad_q, float* delta) {                                      \
        tfmath_flash_backward_query_##NAME((long long)q, (long long)k, (long long)v,        \
                                           (long long)o, (long long)g, (long long)lse,      \
                                           (long long)bias, has_bias, n_query, n_key,       \
                                           is_causal, scale, blockIdx.x, (long long)grad_q, \
                                           (long long)delta);                                \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                 \
        tfmath_flash_backward_key_##NAME##_kernel(                                           \
            const unsigned short* q, const unsigned short* k, const unsigned short* v,      \
            const unsigned short* g, const float* lse, const float* delta,                  \
            const float* bias, int has_bias, int n_query, int n_key, int is_causal,         \
            float scale, float* grad_k, float* grad_v) {                                     \
        tfmath_flash_backward_key_##NAME((long long)q, (long long)k, (long long)v,          \
                                         (long long)g, (long long)lse, (long long)delta,    \
                                         (long long)bias, has_bias, n_query, n_key,         \
                                         is_causal, scale, blockIdx.x, (long long)grad_k,   \
                                         (long long)grad_v);                                 \
    }
#else
#define TFMATH_CHECK_KERNEL(NAME, WARPS)
#define TFMATH_CHECK_BACKWARD_KERNELS(NAME, WARPS)
#endif

// Which entry points to compile: every one, unless the source is prefixed with
// TFMATH_SELECT and TFMATH_WANT_<KIND>_<format>_<D> for the ones wanted.
// tensor_core.py compiles each Numba kernel's C++ that way, with its own entry points
// only: numba-cuda compiles and links the C++ afresh for every kernel, and every entry
// point costs NVRTC and the linker's ptxas their time.
#ifdef TFMATH_SELECT
#define TFMATH_WANTED(KIND, SUFFIX, D) TFMATH_WANT_##KIND##_##SUFFIX##_##D
#else
#define TFMATH_WANTED(KIND, SUFFIX, D) 1
#endif

#if TFMATH_WANTED(FORWARD, f16, 64)
TFMATH_FLASH_FORWARD(F16, f16, 64, 4)
TFMATH_FLASH_FORWARD(F16, f16, 64, 8)
#endif
#if TFMATH_WANTED(FORWARD, f16, 128)
TFMATH_FLASH_FORWARD(F16, f16, 128, 4)
TFMATH_FLASH_FORWARD(F16, f16, 128, 8)
#endif
#if TFMATH_WANTED(FORWARD, bf16, 64)
TFMATH_FLASH_FORWARD(BF16, bf16, 64, 4)
TFMATH_FLASH_FORWARD(BF16, bf16, 64, 8)
#endif
#if TFMATH_WANTED(FORWARD, bf16, 128)
TFMATH_FLASH_FORWARD(BF16, bf16, 128, 4)
TFMATH_FLASH_FORWARD(BF16, bf16, 128, 8)
#endif
// TF32: heads of 64 and 4 warps, whose float32 tiles fill the 48 KiB (at d = 128, or
// 8 warps, they would not).
#if TFMATH_WANTED(FORWARD, tf32, 64)
TFMATH_FLASH_FORWARD(TF32, tf32, 64, 4)
#endif

// The backward's two entry points of one format and head size: WARPS warps a block,
// TILE keys a tile of the dQ kernel's loop and queries a tile of the dK, dV kernel's.
// Operands as the forward's; D_i (delta) float32, one number a query row.
#define TFMATH_FLASH_BACKWARD(T, SUFFIX, D, WARPS, TILE)                                     \
    extern "C" __device__ void tfmath_flash_backward_query_##SUFFIX##_##D##_w##WARPS(        \
        long long query, long long key, long long value, long long out, long long grad_out, \
        long long log_sum_exp, long long bias, int has_bias, int n_query, int n_key,        \
        int is_causal, float scale, int row_tile, long long grad_query, long long delta) {  \
        using Bits = const unsigned short*;                                                  \
        flash_backward_query<T, D, WARPS, TILE>(                                             \
            reinterpret_cast<Bits>(query), reinterpret_cast<Bits>(key),                      \
            reinterpret_cast<Bits>(value), reinterpret_cast<Bits>(out),                      \
            reinterpret_cast<Bits>(grad_out), reinterpret_cast<const float*>(log_sum_exp),   \
            reinterpret_cast<const float*>(bias), has_bias, n_query, n_key, is_causal,       \
            scale, row_tile, reinterpret_cast<float*>(grad_query),                           \
            reinterpret_cast<float*>(delta));                                                \
    }                                                                                        \
    extern "C" __device__ void tfmath_flash_backward_key_##SUFFIX##_##D##_w##WARPS(          \
        long long query, long long key, long long value, long long grad_out,                \
        long long log_sum_exp, long long delta, long long bias, int has_bias, int n_query,  \
        int n_key, int is_causal, float scale, int key_tile, long long grad_key,            \
        long long grad_value) {                                                              \
        using Bits = const unsigned short*;                                                  \
        flash_backward_key<T, D, WARPS, TILE>(                                               \
            reinterpret_cast<Bits>(query), reinterpret_cast<Bits>(key),                      \
            reinterpret_cast<Bits>(value), reinterpret_cast<Bits>(grad_out),                 \
            reinterpret_cast<const float*>(log_sum_exp),                                     \
            reinterpret_cast<const float*>(delta), reinterpret_cast<const float*>(bias),     \
            has_bias, n_query, n_key, is_causal, scale, key_tile,                            \
            reinterpret_cast<float*>(grad_key), reinterpret_cast<float*>(grad_value));       \
    }                                                                                        \
    TFMATH_CHECK_BACKWARD_KERNELS(SUFFIX##_##D##_w##WARPS, WARPS)

// Tiles of 64 at D = 64; at D = 128, 32, so that the four tiles fit the 48 KiB of
// static shared memory (and the accumulators the registers).
#if TFMATH_WANTED(BACKWARD, f16, 64)
TFMATH_FLASH_BACKWARD(F16, f16, 64, 4, 64)
#endif
#if TFMATH_WANTED(BACKWARD, f16, 128)
TFMATH_FLASH_BACKWARD(F16, f16, 128, 4, 32)
#endif
#if TFMATH_WANTED(BACKWARD, bf16, 64)
TFMATH_FLASH_BACKWARD(BF16, bf16, 64, 4, 64)
#endif
#if TFMATH_WANTED(BACKWARD, bf16, 128)
TFMATH_FLASH_BACKWARD(BF16, bf16, 128, 4, 32)
#endif
// TF32 at D = 64: rows of 128 words, as the 16-bit formats' at D = 128, and so their
// tiles of 32.
#if TFMATH_WANTED(BACKWARD, tf32, 64)
TFMATH_FLASH_BACKWARD(TF32, tf32, 64, 4, 32)
#endif
