// A host emulation of the CUDA features that tfmath's tensor-core kernels
// (tfmath/kernels/cuda/tensor_core.cu) use, so that a C++ compiler runs them on the
// CPU, thread for thread, without a GPU (tfmath/tools/warp_emulator.py builds and
// calls it; the tests compare what it computes with the float64 reference).
//
// Every CUDA thread of a block is a fiber (a ucontext of its own stack) on the
// calling host thread; the blocks of a grid run one after another. A fiber runs until
// it waits at a barrier (`__syncthreads`, `__syncwarp`, and inside every warp-wide
// instruction); the scheduler then resumes the others. It runs one warp at a time as
// far as it goes before the next, in orders shuffled by a generator seeded with the
// block's index: runs are reproducible, and warps get ahead of each other as far as
// the barriers let them. The warp-wide instructions (`__shfl_xor_sync`, `ldmatrix`,
// `mma.sync`) are exchanges through a warp's slots between two barriers: each lane
// writes its operands, then reads what its result is made of, as the PTX ISA defines
// the fragments ("Matrix fragments for mma.m16n8k16", "ldmatrix"). The forward kernel
// was checked on an H200 against the float64 reference, and its results here agree
// with it within rounding, which checks these definitions where the kernels use them.
//
// Asynchronous copies (`cp.async`) are the hostile case of what the hardware
// allows: at issue, the 16 destination bytes are filled with NaN patterns; the data
// land when the issuing thread waits for its group. A kernel that reads a tile
// before its copies' wait and barrier, or overwrites a tile that another warp still
// reads, then sees NaN instead of passing by luck.
//
// Products of 16-bit operands are exact in float32 (11 or 8 significant bits
// each); a warp's m16n8k16 product sums them in float32 in k order. The GPU's order
// and rounding of that sum are unspecified, so results agree with a GPU's within
// float32 rounding, not bit for bit.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include <ucontext.h>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

using std::max;
using std::min;

struct dim3 {
    int x = 0, y = 0, z = 0;
};

struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};

struct __attribute__((aligned(8))) float2 {
    float x, y;
};

inline float2 make_float2(float x, float y) { return {x, y}; }

namespace warp_emulator {

// The copies a thread has issued and not yet waited for, by commit group.
struct PendingCopy {
    void* shared;
    unsigned char bytes[16];
};

// One CUDA thread: its context, stack and index, and the copies in flight.
struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    dim3 index;
    bool done = false;
    std::vector<std::vector<PendingCopy>> groups{1};
};

struct Scheduler {
    ucontext_t context;
    Fiber* current = nullptr;
    // Barriers released and fibers finished: a pass of the scheduler that changes
    // neither finds every fiber waiting for one that never comes (a deadlock).
    long progress = 0;
};

inline Scheduler scheduler;

// Back to the scheduler, which resumes this fiber later.
inline void yield() { swapcontext(&scheduler.current->context, &scheduler.context); }

// A barrier for a fixed number of fibers, reusable (generation counted).
class Barrier {
  public:
    explicit Barrier(int count) : count_(count) {}
    // Waits for every fiber; returns the OR of their `vote`s.
    bool wait(bool vote = false) {
        const long generation = generation_;
        vote_ = vote_ || vote;
        if (++arrived_ == count_) {
            result_ = vote_;
            vote_ = false;
            arrived_ = 0;
            ++generation_;
            ++scheduler.progress;
            return result_;
        }
        while (generation_ == generation) yield();
        return result_;
    }

  private:
    int count_, arrived_ = 0;
    long generation_ = 0;
    bool vote_ = false, result_ = false;
};

// What the 32 lanes of a warp exchange in one warp-wide instruction.
struct Slot {
    const void* pointer;
    unsigned words[6];
    float value;
};

struct Warp {
    Barrier barrier{32};
    Slot slots[32];
};

struct Block {
    explicit Block(int threads) : barrier(threads), warps(threads / 32) {}
    Barrier barrier;
    std::vector<Warp> warps;
};

inline Block* block = nullptr;

inline Warp& this_warp(int thread) { return block->warps[thread >> 5]; }

}  // namespace warp_emulator

#define threadIdx (warp_emulator::scheduler.current->index)
inline dim3 blockIdx;

// ---- Barriers and votes --------------------------------------------------------------

inline void __syncthreads() { warp_emulator::block->barrier.wait(); }

inline int __syncthreads_or(int predicate) {
    return warp_emulator::block->barrier.wait(predicate != 0);
}

inline void __syncwarp(unsigned = 0xffffffffu) {
    warp_emulator::this_warp(threadIdx.x).barrier.wait();
}

inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
    auto& warp = warp_emulator::this_warp(threadIdx.x);
    const int lane = threadIdx.x & 31;
    warp.slots[lane].value = value;
    warp.barrier.wait();
    const float result = warp.slots[lane ^ lane_mask].value;
    warp.barrier.wait();
    return result;
}

// ---- Numbers -------------------------------------------------------------------------

inline float __int_as_float(int bits) {
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
}

inline unsigned float_bits(float x) {
    unsigned bits;
    std::memcpy(&bits, &x, 4);
    return bits;
}

inline float __uint_as_float(unsigned bits) { return __int_as_float(static_cast<int>(bits)); }

namespace warp_emulator {

// float -> IEEE binary16, rounded to nearest even (overflow to inf, NaN kept quiet).
inline unsigned short half_from_float(float x) {
    const unsigned bits = float_bits(x);
    const unsigned short sign = (bits >> 16) & 0x8000;
    const unsigned magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00;
    if (magnitude >= 0x477ff000u) return sign | 0x7c00;  // 65520 and above: inf
    if (magnitude < 0x38800000u) {                       // below 2^-14: subnormal or 0
        // x * 2^24 is exact; rounding it to an integer (to nearest even, the host's
        // default mode) gives the subnormal's significand, or 0x400 for 2^-14.
        return sign | static_cast<unsigned short>(std::nearbyint(std::fabs(x) * 16777216.0f));
    }
    const unsigned rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return sign | static_cast<unsigned short>((rounded - 0x38000000u) >> 13);
}

inline float float_from_half(unsigned short h) {
    const unsigned sign = static_cast<unsigned>(h & 0x8000) << 16;
    const unsigned exponent = (h >> 10) & 0x1f, significand = h & 0x3ff;
    if (exponent == 0) {
        const float x = std::ldexp(static_cast<float>(significand), -24);
        return sign ? -x : x;
    }
    const unsigned bits = exponent == 31 ? sign | 0x7f800000u | (significand << 13)
                                         : sign | ((exponent + 112) << 23) | (significand << 13);
    return __int_as_float(static_cast<int>(bits));
}

// float -> bfloat16, rounded to nearest even (NaN kept quiet).
inline unsigned short bfloat16_from_float(float x) {
    const unsigned bits = float_bits(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40);
    return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float float_from_bfloat16(unsigned short b) {
    return __int_as_float(static_cast<int>(static_cast<unsigned>(b) << 16));
}

// cvt.rna.tf32.f32: float -> TF32 (a float32 whose 13 low significand bits are 0),
// rounded to nearest, ties away from zero; inf and NaN kept as they are.
inline unsigned tf32_bits(float x) {
    const unsigned bits = float_bits(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return bits;
    return (bits + 0x1000u) & 0xffffe000u;
}

}  // namespace warp_emulator

struct __half {
    unsigned short bits;
};
struct __half2 {
    __half x, y;
};
struct __nv_bfloat16 {
    unsigned short bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline __half2 __floats2half2_rn(float low, float high) {
    return {{warp_emulator::half_from_float(low)}, {warp_emulator::half_from_float(high)}};
}
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
inline float __half2float(__half h) { return warp_emulator::float_from_half(h.bits); }

inline __nv_bfloat162 __floats2bfloat162_rn(float low, float high) {
    return {{warp_emulator::bfloat16_from_float(low)}, {warp_emulator::bfloat16_from_float(high)}};
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }
inline float __bfloat162float(__nv_bfloat16 b) {
    return warp_emulator::float_from_bfloat16(b.bits);
}

// ---- Asynchronous copies -------------------------------------------------------------

namespace warp_emulator {

inline void copy_async(void* shared, const void* global, bool valid) {
    PendingCopy copy{shared, {}};
    if (valid) std::memcpy(copy.bytes, global, 16);
    scheduler.current->groups.back().push_back(copy);
    std::memset(shared, 0xff, 16);  // NaN in float16 and bfloat16 until the wait
}

inline void commit_copies() { scheduler.current->groups.emplace_back(); }

// cp.async.wait_group 0: lands every committed group (the last group is the open,
// uncommitted one, which stays).
inline void wait_copies() {
    auto& groups = scheduler.current->groups;
    for (std::size_t g = 0; g + 1 < groups.size(); ++g)
        for (const auto& copy : groups[g]) std::memcpy(copy.shared, copy.bytes, 16);
    groups.erase(groups.begin(), groups.end() - 1);
}

// ---- ldmatrix and mma.sync -----------------------------------------------------------

// ldmatrix .m8n8.x4 (.trans): lane l gives the address of row l % 8 of matrix l / 8;
// register m of lane l holds, of matrix m, the two numbers at row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 (transposed: rows 2 (l % 4) and 2 (l % 4) + 1 of
// column l / 4), the first in the low half.
inline void load_matrix_x4(unsigned r[4], const void* p, bool transposed) {
    auto& warp = this_warp(threadIdx.x);
    const int lane = threadIdx.x & 31;
    warp.slots[lane].pointer = p;
    warp.barrier.wait();
    for (int m = 0; m < 4; ++m) {
        unsigned short low, high;
        auto row = [&](int r) { return static_cast<const unsigned short*>(warp.slots[r].pointer); };
        if (!transposed) {
            low = row(8 * m + lane / 4)[2 * (lane % 4)];
            high = row(8 * m + lane / 4)[2 * (lane % 4) + 1];
        } else {
            low = row(8 * m + 2 * (lane % 4))[lane / 4];
            high = row(8 * m + 2 * (lane % 4) + 1)[lane / 4];
        }
        r[m] = low | (static_cast<unsigned>(high) << 16);
    }
    warp.barrier.wait();
}

inline unsigned short half_of(unsigned word, int k) {
    return static_cast<unsigned short>(k & 1 ? word >> 16 : word & 0xffff);
}

// The product D = A B + C of one mma.sync of K steps, C and D float32 16 x 8: every lane
// publishes its registers (a0..a3, b0, b1) to the warp, then sums its accumulators
// c0..c3, rows (g, g, g + 8, g + 8) and columns (2t, 2t + 1, 2t, 2t + 1) with
// g = lane / 4 and t = lane % 4, over a_at(slots, row, k) b_at(slots, k, col): the
// operands' values, which the instruction's fragment layout places in the published
// registers.
template <int K, class AAt, class BAt>
void warp_product(float c[4], const unsigned a[4], unsigned b0, unsigned b1, AAt a_at,
                  BAt b_at) {
    auto& warp = this_warp(threadIdx.x);
    const int lane = threadIdx.x & 31;
    Slot& mine = warp.slots[lane];
    for (int i = 0; i < 4; ++i) mine.words[i] = a[i];
    mine.words[4] = b0;
    mine.words[5] = b1;
    warp.barrier.wait();
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float sum = c[e];
        for (int k = 0; k < K; ++k) sum += a_at(warp.slots, row, k) * b_at(warp.slots, k, col);
        c[e] = sum;
    }
    warp.barrier.wait();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: A's registers a0..a3
// hold rows (g, g + 8, g, g + 8) at columns 2t, 2t + 1 (+ 8 for a2, a3); B's b0, b1 rows
// 2t, 2t + 1 (+ 8 for b1) of column g.
template <class T>
void mma_16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    // A(row, k): lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8).
    auto a_at = [](const Slot* slots, int row, int k) {
        const unsigned word = slots[4 * (row % 8) + (k % 8) / 2].words[(row >= 8) + 2 * (k >= 8)];
        return T::to_float(half_of(word, k));
    };
    // B(k, col): lane 4 col + (k % 8) / 2, register b0 (k < 8) or b1.
    auto b_at = [](const Slot* slots, int k, int col) {
        return T::to_float(half_of(slots[4 * col + (k % 8) / 2].words[4 + (k >= 8)], k));
    };
    warp_product<16>(c, a, b0, b1, a_at, b_at);
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, operands float32 registers of which
// the tensor cores read the TF32 part (the 13 low significand bits ignored): A's a0..a3
// hold rows (g, g + 8, g, g + 8) at columns (t, t, t + 4, t + 4); B's b0, b1 rows t,
// t + 4 of column g.
inline void mma_1688_tf32(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    auto tf32 = [](unsigned word) { return __uint_as_float(word & 0xffffe000u); };
    auto a_at = [&](const Slot* slots, int row, int k) {
        return tf32(slots[4 * (row % 8) + k % 4].words[(row >= 8) + 2 * (k >= 4)]);
    };
    auto b_at = [&](const Slot* slots, int k, int col) {
        return tf32(slots[4 * col + k % 4].words[4 + (k >= 4)]);
    };
    warp_product<8>(c, a, b0, b1, a_at, b_at);
}

// Runs `body` on every thread of `n_blocks` blocks of `threads` threads, one block at
// a time, `blockIdx.x` and `threadIdx.x` set as on a GPU. Returns 0, or 1 where the
// threads of a block deadlocked (some wait at a barrier the others never reach, as a
// warp-wide instruction under a divergent branch would); the rest of the grid is not
// run then.
inline int launch(int n_blocks, int threads, const std::function<void()>& body) {
    // Enough for the kernels' frames (arrays of a few hundred floats) and the emulator's.
    constexpr std::size_t STACK = 256 * 1024;
    static const std::function<void()>* running;
    running = &body;
    auto entry = [] {
        (*running)();
        scheduler.current->done = true;
        ++scheduler.progress;
        swapcontext(&scheduler.current->context, &scheduler.context);
    };
    static void (*start)() = entry;
    for (int b = 0; b < n_blocks; ++b) {
        Block this_block(threads);
        block = &this_block;
        blockIdx.x = b;
        std::vector<Fiber> fibers(threads);
        std::vector<int> order(threads);
        for (int t = 0; t < threads; ++t) {
            Fiber& fiber = fibers[t];
            fiber.index.x = t;
            fiber.stack.reset(new char[STACK]);
            getcontext(&fiber.context);
            fiber.context.uc_stack.ss_sp = fiber.stack.get();
            fiber.context.uc_stack.ss_size = STACK;
            fiber.context.uc_link = nullptr;
            makecontext(&fiber.context, start, 0);
            order[t] = t;
        }
        // Each pass takes the warps in a shuffled order and runs each as far as it goes
        // alone (until its lanes all wait at a block-wide barrier, or finish), its lanes
        // in a shuffled order too: one warp gets ahead of the others by up to a whole
        // phase between barriers, so that a missing barrier lets it overwrite what they
        // still read.
        std::minstd_rand shuffle(static_cast<unsigned>(b) + 1);
        std::vector<int> warp_order(threads / 32);
        for (int w = 0; w < threads / 32; ++w) warp_order[w] = w;
        for (int running_fibers = threads; running_fibers > 0;) {
            std::shuffle(warp_order.begin(), warp_order.end(), shuffle);
            const long progress = scheduler.progress;
            running_fibers = 0;
            for (int w : warp_order) {
                int lanes_running;
                long warp_progress;
                do {
                    warp_progress = scheduler.progress;
                    std::shuffle(order.begin() + 32 * w, order.begin() + 32 * w + 32, shuffle);
                    lanes_running = 0;
                    for (int i = 32 * w; i < 32 * w + 32; ++i) {
                        Fiber& fiber = fibers[order[i]];
                        if (fiber.done) continue;
                        scheduler.current = &fiber;
                        swapcontext(&scheduler.context, &fiber.context);
                        lanes_running += !fiber.done;
                    }
                } while (lanes_running > 0 && scheduler.progress != warp_progress);
                running_fibers += lanes_running;
            }
            if (running_fibers > 0 && scheduler.progress == progress) {
                block = nullptr;
                return 1;
            }
        }
        block = nullptr;
    }
    return 0;
}

}  // namespace warp_emulator
