// FlashAttention-2's forward on the tensor cores, for tfmath's half-precision
// attention (tfmath/kernels/cuda/tensor_core.py calls it from a Numba kernel,
// linked with numba-cuda's `link=` and compiled by NVRTC).
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int BC = 64;  // keys per tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// -inf without math.h, which NVRTC lacks.
#define NEG_INF __int_as_float(0xff800000)

struct F16 {
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
    static __device__ unsigned pack(float low, float high) {
        __nv_bfloat162 h = __floats2bfloat162_rn(low, high);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ float to_float(unsigned short x) {
        return __bfloat162float(__ushort_as_bfloat16(x));
    }
    static constexpr unsigned short EXPONENT = 0x7F80;
};

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

// Offset, in 16-bit numbers, of chunk `chunk` (8 numbers) of row `row` in a
// swizzled tile of D numbers a row.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) << 3);
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

// Whether a 16-bit number in the chunks this thread copied is inf or NaN.
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
            found |= (words[w] & T::EXPONENT) == T::EXPONENT;
            found |= ((words[w] >> 16) & T::EXPONENT) == T::EXPONENT;
        }
    }
    return found;
}

template <class T, int D, int WARPS>
__device__ void flash_forward(const unsigned short* query, const unsigned short* key,
                              const unsigned short* value, const float* bias, int has_bias,
                              int n_query, int n_key, int is_causal, float scale, int row_tile,
                              unsigned short* out, float* log_sum_exp) {
    constexpr int KSTEPS = D / 16;  // 16-wide steps of the scores' inner dimension
    constexpr int NTILES = BC / 8;  // 8-key column tiles of the scores
    constexpr int OTILES = D / 8;   // 8-feature column tiles of the output
    constexpr int THREADS = 32 * WARPS, BR = 16 * WARPS;
    static_assert(BR <= 2 * BC, "the Q tile passes through the K and V tiles");
    // The K and V tiles, and first the Q tile, whose fragments then stay in registers.
    __shared__ __align__(128) unsigned short kv_tile[2 * BC * D];
    // The rounded weights of a value tile that needs the careful loop, each warp its rows.
    __shared__ __align__(128) unsigned short weight_tile[BR * BC];
    unsigned short* const q_tile = kv_tile;
    unsigned short* const k_tile = kv_tile;
    unsigned short* const v_tile = kv_tile + BC * D;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_row = row_tile * BR;
    const int warp_row = first_row + warp * 16;
    // This thread's two rows (g and g + 8 of the warp's 16) and its column pair.
    const int row0 = warp_row + (lane >> 2), row1 = row0 + 8;
    const int pair = 2 * (lane & 3);
    const float scale_log2 = scale * LOG2E;

    const int key_end = is_causal ? min(n_key, first_row + BR) : n_key;
    const int n_tiles = (key_end + BC - 1) / BC;

    copy_tile<D, BR, THREADS>(q_tile, query, first_row, n_query);
    commit_copies();
    wait_copies();
    __syncthreads();

    unsigned q_frag[KSTEPS][4];
    #pragma unroll
    for (int k = 0; k < KSTEPS; ++k)
        load_matrix_x4(q_frag[k], q_tile + swizzled<D>(warp * 16 + (lane & 15), 2 * k + (lane >> 4)));
    // Every warp holds its fragments before the first key tile overwrites Q's.
    __syncthreads();
    copy_tile<D, BC, THREADS>(k_tile, key, 0, n_key);
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
        copy_tile<D, BC, THREADS>(v_tile, value, start, n_key);
        commit_copies();

        float s[NTILES][4];
        #pragma unroll
        for (int j = 0; j < NTILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        #pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            #pragma unroll
            for (int j = 0; j < NTILES; j += 2) {
                unsigned b[4];
                load_matrix_x4(b, k_tile + swizzled<D>(8 * j + (lane & 7) + ((lane >> 4) << 3),
                                                       2 * k + ((lane >> 3) & 1)));
                mma_16816<T>(s[j], q_frag[k], b[0], b[1]);
                mma_16816<T>(s[j + 1], q_frag[k], b[2], b[3]);
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
        unsigned p_frag[BC / 16][4];
        #pragma unroll
        for (int k = 0; k < BC / 16; ++k) {
            p_frag[k][0] = T::pack(s[2 * k][0], s[2 * k][1]);
            p_frag[k][1] = T::pack(s[2 * k][2], s[2 * k][3]);
            p_frag[k][2] = T::pack(s[2 * k + 1][0], s[2 * k + 1][1]);
            p_frag[k][3] = T::pack(s[2 * k + 1][2], s[2 * k + 1][3]);
        }

        // The value tile has landed; every warp is done with the key tile. Only a tile
        // with a masked position can pair a weight of 0 with inf or NaN: elsewhere every
        // weight is positive (one that underflows to 0 belongs to a row whose exact
        // output is already inf or NaN), so the scan is skipped. The condition is the
        // same on every thread of the block, as the barriers need.
        wait_copies();
        const bool may_mask = has_bias || (is_causal && start + BC - 1 > first_row);
        bool careful = false;
        if (may_mask)
            careful = __syncthreads_or(copied_non_finite<T, D, THREADS>(v_tile));
        else
            __syncthreads();
        if (tile + 1 < n_tiles) copy_tile<D, BC, THREADS>(k_tile, key, start + BC, n_key);
        commit_copies();

        if (!careful) {
            #pragma unroll
            for (int k = 0; k < BC / 16; ++k) {
                #pragma unroll
                for (int j = 0; j < OTILES; j += 2) {
                    unsigned b[4];
                    load_matrix_x4_transposed(
                        b, v_tile + swizzled<D>(16 * k + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                j + (lane >> 4)));
                    mma_16816<T>(acc[j], p_frag[k], b[0], b[1]);
                    mma_16816<T>(acc[j + 1], p_frag[k], b[2], b[3]);
                }
            }
        } else {
            // The rounded weights through shared memory (each warp its 16 rows),
            // then every output entry of this thread summed over the keys whose
            // weight is not 0.
            unsigned short* weights = weight_tile + warp * 16 * BC;
            #pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const unsigned word = p_frag[j >> 1][2 * (j & 1) + (e >> 1)];
                    weights[((lane >> 2) + 8 * (e >> 1)) * BC + 8 * j + pair + (e & 1)] =
                        static_cast<unsigned short>(word >> (16 * (e & 1)));
                }
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
                        const float p = T::to_float(weights[r * BC + t]);
                        if (p != 0.f)
                            sum += p * T::to_float(v_tile[swizzled<D>(t, f >> 3) + (f & 7)]);
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
        // Rounded to the operands' format here, two numbers a 4-byte store.
        unsigned* out_row = reinterpret_cast<unsigned*>(out + (long long)row * D);
        #pragma unroll
        for (int j = 0; j < OTILES; ++j)
            out_row[(8 * j + pair) / 2] =
                T::pack(acc[j][2 * r] * inverse, acc[j][2 * r + 1] * inverse);
        if (log_sum_exp != nullptr && (lane & 3) == 0)
            log_sum_exp[row] = empty ? NEG_INF : (row_max[r] + log2f(total)) * LN2;
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
#else
#define TFMATH_CHECK_KERNEL(NAME, WARPS)
#endif

TFMATH_FLASH_FORWARD(F16, f16, 64, 4)
TFMATH_FLASH_FORWARD(F16, f16, 64, 8)
TFMATH_FLASH_FORWARD(F16, f16, 128, 4)
TFMATH_FLASH_FORWARD(F16, f16, 128, 8)
TFMATH_FLASH_FORWARD(BF16, bf16, 64, 4)
TFMATH_FLASH_FORWARD(BF16, bf16, 64, 8)
TFMATH_FLASH_FORWARD(BF16, bf16, 128, 4)
TFMATH_FLASH_FORWARD(BF16, bf16, 128, 8)
