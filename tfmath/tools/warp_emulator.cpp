// The tensor-core kernels of tfmath/kernels/cuda/tensor_core.cu on the host, through
// warp_emulator.h: one C function per entry point, which launches its grid as the
// Numba kernels of tfmath/kernels/cuda/tensor_core.py do, on operands without
// broadcasting (batch entry b of every operand at b times its size), and returns 0,
// or 1 where the threads of a block deadlocked. tfmath/tools/warp_emulator.py
// compiles this file and calls it with ctypes.

#include "warp_emulator.h"

#include "tensor_core.cu"

namespace {

using Bits = unsigned short;

inline long long at(const void* base, long long offset_bytes) {
    return base == nullptr ? 0 : reinterpret_cast<long long>(base) + offset_bytes;
}

}  // namespace

// BYTES: the size of an operand's number (2, or 4 for TF32's float32).
#define EMULATE_FORWARD(SUFFIX, D, WARPS, BYTES)                                               \
    extern "C" int emulate_flash_forward_##SUFFIX##_##D##_w##WARPS(                            \
        const Bits* query, const Bits* key, const Bits* value, const float* bias, int n_batch, \
        int n_query, int n_key, int is_causal, float scale, Bits* out, float* log_sum_exp) {   \
        const int n_tiles = (n_query + 16 * WARPS - 1) / (16 * WARPS);                         \
        return warp_emulator::launch(n_batch * n_tiles, 32 * WARPS, [&] {                      \
            const long long b = blockIdx.x % n_batch;                                          \
            const int row_tile = n_tiles - 1 - blockIdx.x / n_batch;                           \
            tfmath_flash_forward_##SUFFIX##_##D##_w##WARPS(                                    \
                at(query, BYTES * b * n_query * D), at(key, BYTES * b * n_key * D),            \
                at(value, BYTES * b * n_key * D), at(bias, 4 * b * n_query * n_key),           \
                bias != nullptr, n_query, n_key, is_causal, scale, row_tile,                   \
                at(out, BYTES * b * n_query * D), at(log_sum_exp, 4 * b * n_query));           \
        });                                                                                    \
    }

EMULATE_FORWARD(f16, 64, 4, 2)
EMULATE_FORWARD(f16, 64, 8, 2)
EMULATE_FORWARD(f16, 128, 4, 2)
EMULATE_FORWARD(f16, 128, 8, 2)
EMULATE_FORWARD(bf16, 64, 4, 2)
EMULATE_FORWARD(bf16, 64, 8, 2)
EMULATE_FORWARD(bf16, 128, 4, 2)
EMULATE_FORWARD(bf16, 128, 8, 2)
EMULATE_FORWARD(tf32, 64, 4, 4)

#define EMULATE_BACKWARD(SUFFIX, D, WARPS, BYTES)                                              \
    extern "C" int emulate_flash_backward_##SUFFIX##_##D##_w##WARPS(                           \
        const Bits* query, const Bits* key, const Bits* value, const Bits* out,                \
        const Bits* grad_out, const float* log_sum_exp, const float* bias, int n_batch,        \
        int n_query, int n_key, int is_causal, float scale, float* grad_query, float* delta,   \
        float* grad_key, float* grad_value) {                                                  \
        const int rows = 16 * WARPS;                                                           \
        const int query_tiles = (n_query + rows - 1) / rows;                                   \
        const int key_tiles = (n_key + rows - 1) / rows;                                       \
        const int failed = warp_emulator::launch(n_batch * query_tiles, 32 * WARPS, [&] {      \
            const long long b = blockIdx.x % n_batch;                                          \
            tfmath_flash_backward_query_##SUFFIX##_##D##_w##WARPS(                             \
                at(query, BYTES * b * n_query * D), at(key, BYTES * b * n_key * D),            \
                at(value, BYTES * b * n_key * D), at(out, BYTES * b * n_query * D),            \
                at(grad_out, BYTES * b * n_query * D), at(log_sum_exp, 4 * b * n_query),       \
                at(bias, 4 * b * n_query * n_key), bias != nullptr, n_query, n_key, is_causal, \
                scale, blockIdx.x / n_batch, at(grad_query, 4 * b * n_query * D),              \
                at(delta, 4 * b * n_query));                                                   \
        });                                                                                    \
        if (failed) return failed;                                                             \
        return warp_emulator::launch(n_batch * key_tiles, 32 * WARPS, [&] {                    \
            const long long b = blockIdx.x % n_batch;                                          \
            tfmath_flash_backward_key_##SUFFIX##_##D##_w##WARPS(                               \
                at(query, BYTES * b * n_query * D), at(key, BYTES * b * n_key * D),            \
                at(value, BYTES * b * n_key * D), at(grad_out, BYTES * b * n_query * D),       \
                at(log_sum_exp, 4 * b * n_query), at(delta, 4 * b * n_query),                  \
                at(bias, 4 * b * n_query * n_key), bias != nullptr, n_query, n_key, is_causal, \
                scale, blockIdx.x / n_batch, at(grad_key, 4 * b * n_key * D),                  \
                at(grad_value, 4 * b * n_key * D));                                            \
        });                                                                                    \
    }

EMULATE_BACKWARD(f16, 64, 4, 2)
EMULATE_BACKWARD(f16, 128, 4, 2)
EMULATE_BACKWARD(bf16, 64, 4, 2)
EMULATE_BACKWARD(bf16, 128, 4, 2)
EMULATE_BACKWARD(tf32, 64, 4, 4)

// The 16-bit formats' rounding of `n` float32 numbers, as the kernels' T::pack does.
extern "C" void emulate_round_f16(const float* values, Bits* bits, long n) {
    for (long i = 0; i < n; ++i) bits[i] = warp_emulator::half_from_float(values[i]);
}

extern "C" void emulate_round_bf16(const float* values, Bits* bits, long n) {
    for (long i = 0; i < n; ++i) bits[i] = warp_emulator::bfloat16_from_float(values[i]);
}

// TF32's rounding (cvt.rna) of `n` float32 numbers, as float32 bit patterns.
extern "C" void emulate_round_tf32(const float* values, unsigned* bits, long n) {
    for (long i = 0; i < n; ++i) bits[i] = warp_emulator::tf32_bits(values[i]);
}

// One block of an entry point, on the arguments the Numba kernels of
// tfmath/kernels/cuda/tensor_core.py pass it (device addresses as integers): the tests
// call these from those kernels run on Numba's CUDA simulator, where a device address is
// a host one, so that the whole path from the public API to the C++ runs without a GPU.
namespace {

template <class... Parameters, class... Arguments>
int run_block(int threads, void (*entry)(Parameters...), Arguments... arguments) {
    return warp_emulator::launch(1, threads, [&] { entry(arguments...); });
}

}  // namespace

#define EMULATE_FORWARD_BLOCK(SUFFIX, D, WARPS)                                                \
    extern "C" int emulate_block_tfmath_flash_forward_##SUFFIX##_##D##_w##WARPS(               \
        long long query, long long key, long long value, long long bias, int has_bias,         \
        int n_query, int n_key, int is_causal, float scale, int row_tile, long long out,       \
        long long log_sum_exp) {                                                               \
        return run_block(32 * WARPS, tfmath_flash_forward_##SUFFIX##_##D##_w##WARPS, query,    \
                         key, value, bias, has_bias, n_query, n_key, is_causal, scale,         \
                         row_tile, out, log_sum_exp);                                          \
    }

#define EMULATE_BACKWARD_BLOCKS(SUFFIX, D, WARPS)                                              \
    extern "C" int emulate_block_tfmath_flash_backward_query_##SUFFIX##_##D##_w##WARPS(        \
        long long query, long long key, long long value, long long out, long long grad_out,    \
        long long log_sum_exp, long long bias, int has_bias, int n_query, int n_key,           \
        int is_causal, float scale, int row_tile, long long grad_query, long long delta) {     \
        return run_block(32 * WARPS, tfmath_flash_backward_query_##SUFFIX##_##D##_w##WARPS,    \
                         query, key, value, out, grad_out, log_sum_exp, bias, has_bias,        \
                         n_query, n_key, is_causal, scale, row_tile, grad_query, delta);       \
    }                                                                                          \
    extern "C" int emulate_block_tfmath_flash_backward_key_##SUFFIX##_##D##_w##WARPS(          \
        long long query, long long key, long long value, long long grad_out,                   \
        long long log_sum_exp, long long delta, long long bias, int has_bias, int n_query,     \
        int n_key, int is_causal, float scale, int key_tile, long long grad_key,               \
        long long grad_value) {                                                                \
        return run_block(32 * WARPS, tfmath_flash_backward_key_##SUFFIX##_##D##_w##WARPS,      \
                         query, key, value, grad_out, log_sum_exp, delta, bias, has_bias,      \
                         n_query, n_key, is_causal, scale, key_tile, grad_key, grad_value);    \
    }

EMULATE_FORWARD_BLOCK(f16, 64, 4)
EMULATE_FORWARD_BLOCK(f16, 64, 8)
EMULATE_FORWARD_BLOCK(f16, 128, 4)
EMULATE_FORWARD_BLOCK(f16, 128, 8)
EMULATE_FORWARD_BLOCK(bf16, 64, 4)
EMULATE_FORWARD_BLOCK(bf16, 64, 8)
EMULATE_FORWARD_BLOCK(bf16, 128, 4)
EMULATE_FORWARD_BLOCK(bf16, 128, 8)
EMULATE_FORWARD_BLOCK(tf32, 64, 4)
EMULATE_BACKWARD_BLOCKS(f16, 64, 4)
EMULATE_BACKWARD_BLOCKS(f16, 128, 4)
EMULATE_BACKWARD_BLOCKS(bf16, 64, 4)
EMULATE_BACKWARD_BLOCKS(bf16, 128, 4)
EMULATE_BACKWARD_BLOCKS(tf32, 64, 4)
