// `y = x @ W^T` from MLX affine-quantized weights, as one MLX CPU primitive
// (mlxhost's CPU decode path, issue "CPU decode from 4-bit weights").
//
// Weight layout: MLX's `mx.quantize` (mlx/backend/cpu/quantized.cpp):
// `w [N, K * bits / 32]` uint32, little-endian, element j of a row in bits
// `[bits * j, bits * (j + 1))` of the row's bytes (4-bit: byte i holds
// elements 2i in its low and 2i + 1 in its high nibble); `scales`, `biases`
// `[N, K / group]` float32; weight (n, k) = scales[n, k / group] * q + biases[n, k / group].
//
// Decode-sized products (M <= kMaxKernelRows rows) are computed straight
// from the packed weights: each group of 32 weights is dequantized in
// registers (AVX2 + FMA where the CPU has them, else a portable loop the
// compiler vectorizes, NEON on Apple CPUs) and multiplied with up to 4 rows
// of x at a time, so the weights stream from memory once per 4 rows at 4 or
// 8 bits instead of 32. Larger products (prefill) dequantize a tile of W
// rows into a float32 buffer that stays in the L2 cache and hand it to BLAS
// (`cblas_sgemm`, OpenBLAS when linked), so prefill keeps BLAS's speed while
// the weights stay quantized in memory. Both are split over output rows on a
// small thread pool (the calling thread plus `MLXHOST_CPU_THREADS - 1`
// workers, default: one per core).
//
// Inputs:  x [M, K] float32 (row-contiguous), w, scales, biases as above.
// Output:  y [M, N] float32.
// CPU only: on a GPU stream the host never builds this op (eval_gpu throws).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "cpu_kernels.h"

namespace mx = mlx::core;

namespace mlxhost_cpu {

constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;

} // namespace mlxhost_cpu

#if defined(MLXHOST_NO_CBLAS)
// Built without a CPU BLAS (the `openblas` feature off: the NVIDIA build,
// whose GPU path never runs these CPU kernels; the CPU wheel's libmlx does
// not export its BLAS). A plain product for the two calls below (row-major,
// A not transposed), correct but without BLAS's speed.
// (Same parameters as CBLAS's `cblas_sgemm`; order and trans_a unused.)
static void cblas_sgemm(int, int, int trans_b, int m, int n, int k, float alpha,
                        const float* a, int lda, const float* b, int ldb, float beta,
                        float* c, int ldc) {
  const bool bt = trans_b == mlxhost_cpu::kCblasTrans;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int p = 0; p < k; ++p) {
        const float bv = bt ? b[size_t(j) * ldb + p] : b[size_t(p) * ldb + j];
        acc += a[size_t(i) * lda + p] * bv;
      }
      float& out = c[size_t(i) * ldc + j];
      out = beta == 0.0f ? alpha * acc : alpha * acc + beta * out;
    }
  }
}
#else
// BLAS (CBLAS interface), provided by OpenBLAS (the `openblas` feature) or
// Accelerate on macOS.
extern "C" void cblas_sgemm(
    int order,
    int trans_a,
    int trans_b,
    int m,
    int n,
    int k,
    float alpha,
    const float* a,
    int lda,
    const float* b,
    int ldb,
    float beta,
    float* c,
    int ldc);
#endif

namespace mlxhost_cpu {

// Largest row count computed straight from the packed weights; more rows go
// through tile dequantization and BLAS (see `mlxhost_quantized_matmul_max_rows`).
constexpr int kMaxKernelRows = 16;

// Weight rows ahead that the int8 kernel prefetches (`MLXHOST_PREFETCH_ROWS`
// overrides, for measuring).
const int kPrefetchRows = [] {
  const char* env = std::getenv("MLXHOST_PREFETCH_ROWS");
  return env ? std::max(0, std::atoi(env)) : 4;
}();

// ---------------------------------------------------------------------------
// Thread pool: the caller and N-1 workers share `n` tasks. Workers spin for a
// short while after a job (the next matrix product of a decode step follows
// within microseconds) and then sleep on a condition variable, so an idle
// server costs no CPU.
//
// The caller waits only for the tasks that were claimed, never for a worker
// to show up: a worker still asleep (or descheduled on a machine whose other
// core is busy) when the job starts simply finds nothing left to claim.
// Waiting for every worker to acknowledge made a decode step several times
// slower on a loaded 2-core machine (measured: 9 -> 24-87 ms per token while
// a build ran on the other core). Tasks are claimed with one CAS on a word
// holding (job, next index), and each job's function and size live in one of
// two slots by job parity, so a worker that arrives late can neither claim a
// task of a finished job nor read a slot the caller is refilling (the slot of
// job j is rewritten for job j + 2, which cannot start before every task of
// job j + 1, and so of job j, is done).
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  int threads() const {
    return int(workers_.size()) + 1;
  }

  // Runs fn(i) for every i in [0, n) and returns when all have run.
  // `spin_after = false`: workers sleep right after this job instead of
  // spinning (the caller is about to run BLAS, whose threads need the cores).
  void run(int n, const std::function<void(int)>& fn, bool spin_after = true) {
    if (workers_.empty() || n <= 1) {
      for (int i = 0; i < n; i++)
        fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mu_);
    const uint32_t job = ++job_;
    Slot& slot = slots_[job & 1];
    slot.fn.store(&fn, std::memory_order_relaxed);
    slot.n.store(n, std::memory_order_relaxed);
    spin_after_.store(spin_after, std::memory_order_relaxed);
    completed_.store(0, std::memory_order_relaxed);
    // Publishes the slot and the reset counter with the job.
    claim_.store(uint64_t(job) << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    // The claimed tasks still running on workers; yield now and then so a
    // worker descheduled onto this core can finish its task.
    for (int iter = 1; completed_.load(std::memory_order_acquire) != n; iter++) {
      pause();
      if (iter % 1024 == 0)
        std::this_thread::yield();
    }
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_)
      t.join();
  }

 private:
  // Atomics only so that a stale worker's read of a slot being refilled is
  // not a data race (its CAS then fails and it uses nothing it read).
  struct Slot {
    std::atomic<const std::function<void(int)>*> fn{nullptr};
    std::atomic<int> n{0};
  };

  Pool() {
    int n = int(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("MLXHOST_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0)
        n = v;
    }
    n = std::clamp(n, 1, 64);
    if (const char* env = std::getenv("MLXHOST_POOL_SPIN_US")) {
      spin_us_ = std::max(0, std::atoi(env));
    }
    for (int i = 1; i < n; i++)
      workers_.emplace_back([this] { loop(); });
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Claims and runs tasks of the current job until none is left.
  void work() {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t job = uint32_t(c >> 32), i = uint32_t(c);
      const Slot& slot = slots_[job & 1];
      if (i >= uint32_t(slot.n.load(std::memory_order_relaxed)))
        return;
      // On success the job is still current and task i is ours; on failure
      // c holds the new value (another claim, or a later job).
      if (claim_.compare_exchange_weak(
              c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        (*slot.fn.load(std::memory_order_relaxed))(int(i));
        completed_.fetch_add(1, std::memory_order_acq_rel);
        c = claim_.load(std::memory_order_acquire);
      }
    }
  }

  void loop() {
    // Generation 0 is the pool's start: a job posted before this thread
    // first runs must still be seen as new.
    uint64_t seen = 0;
    for (;;) {
      // Spin first, then sleep.
      auto start = std::chrono::steady_clock::now();
      uint64_t now_gen;
      int iter = 0;
      const int spin_us = spin_after_.load(std::memory_order_relaxed) ? spin_us_ : 0;
      while ((now_gen = gen_.load(std::memory_order_acquire)) == seen) {
        pause();
        if (++iter % 256 == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us)) {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
          now_gen = gen_.load(std::memory_order_acquire);
          break;
        }
      }
      seen = now_gen;
      if (stop_)
        return;
      work();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  // Wake-ups (one per job and the stop).
  std::atomic<uint64_t> gen_{0};
  // (job << 32) | next unclaimed task index.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> completed_{0};
  uint32_t job_ = 0;
  Slot slots_[2];
  bool stop_ = false;
  std::atomic<bool> spin_after_{true};
  int spin_us_ = 200;
};

// ---------------------------------------------------------------------------
// Kernels. Each computes y[m, n] for rows m in [0, M) and output rows n in
// [n0, n1).

// One weight row's elements [k0, k0 + 32) dequantized (portable).
inline void dequant32(const Problem& p, const uint8_t* wrow, int k0, float s, float b, float* out) {
  if (p.bits == 4) {
    const uint8_t* src = wrow + k0 / 2;
    for (int i = 0; i < 16; i++) {
      out[2 * i] = s * float(src[i] & 0x0F) + b;
      out[2 * i + 1] = s * float(src[i] >> 4) + b;
    }
  } else {
    const uint8_t* src = wrow + k0;
    for (int i = 0; i < 32; i++)
      out[i] = s * float(src[i]) + b;
  }
}

// Portable kernel (scalar code the compiler vectorizes: SSE on x86 without
// AVX2, NEON on aarch64).
void kernel_portable(const Problem& p, int n0, int n1) {
  const int row_bytes = p.K * p.bits / 8;
  const int groups = p.K / p.group;
  float wbuf[32];
  for (int n = n0; n < n1; n++) {
    const uint8_t* wrow = p.w + size_t(n) * row_bytes;
    float acc[kMaxKernelRows] = {};
    for (int g = 0; g < groups; g++) {
      const float s = p.scales[size_t(n) * groups + g];
      const float b = p.biases[size_t(n) * groups + g];
      for (int k0 = g * p.group; k0 < (g + 1) * p.group; k0 += 32) {
        dequant32(p, wrow, k0, s, b, wbuf);
        for (int m = 0; m < p.M; m++) {
          const float* xr = p.x + size_t(m) * p.K + k0;
          float part[8] = {};
          for (int i = 0; i < 32; i += 8)
            for (int j = 0; j < 8; j++)
              part[j] += wbuf[i + j] * xr[i + j];
          float t = 0;
          for (int j = 0; j < 8; j++)
            t += part[j];
          acc[m] += t;
        }
      }
    }
    for (int m = 0; m < p.M; m++)
      p.y[size_t(m) * p.N + n] = acc[m];
  }
}

// Runs block(MC, m0, c0, c1) over chunks [c0, c1) of the weight rows [n0, n1)
// that stay in L1 while every block of up to 4 x rows reads them (MC a
// compile-time `std::integral_constant`), so a 16-row product still streams
// W from memory once.
template <typename Block>
inline void for_row_blocks(const Problem& p, int bits, int n0, int n1, Block&& block) {
  const int row_bytes = p.K * bits / 8;
  const int chunk = std::max(1, (16 * 1024) / std::max(1, row_bytes));
  for (int c0 = n0; c0 < n1; c0 += chunk) {
    const int c1 = std::min(n1, c0 + chunk);
    int m = 0;
    for (; m + 4 <= p.M; m += 4)
      block(std::integral_constant<int, 4>{}, m, c0, c1);
    switch (p.M - m) {
      case 3:
        block(std::integral_constant<int, 3>{}, m, c0, c1);
        break;
      case 2:
        block(std::integral_constant<int, 2>{}, m, c0, c1);
        break;
      case 1:
        block(std::integral_constant<int, 1>{}, m, c0, c1);
        break;
      default:
        break;
    }
  }
}

// Calls f(PG): the blocks of 32 per weight group as a compile-time constant
// (1, 2, 4 for groups of 32, 64, 128, so the group index is a shift), 0 for
// other group sizes (a division).
template <typename F>
inline void with_blocks_per_group(int group, F&& f) {
  switch (group) {
    case 32:
      f(std::integral_constant<int, 1>{});
      break;
    case 64:
      f(std::integral_constant<int, 2>{});
      break;
    case 128:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 0>{});
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// 32 weights starting at element k0 of `wrow`, dequantized into w[0..3]
// (8 floats each, in element order).
template <int BITS>
__attribute__((target("avx2,fma"))) inline void
dequant32_avx2(const uint8_t* wrow, int k0, __m256 s, __m256 b, __m256* w) {
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + k0 / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m128i a = _mm_unpacklo_epi8(lo, hi); // elements 0..15
    const __m128i c = _mm_unpackhi_epi8(lo, hi); // elements 16..31
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)), s, b);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), s, b);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)), s, b);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8))), s, b);
  } else {
    const uint8_t* src = wrow + k0;
    for (int i = 0; i < 4; i++) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s, b);
    }
  }
}

// Rows [m0, m0 + MC) of x against weight rows [n0, n1). Two accumulators per
// row so consecutive FMAs do not wait on each other.
template <int BITS, int MC>
__attribute__((target("avx2,fma"))) void
block_avx2(const Problem& p, int m0, int n0, int n1) {
  const int row_bytes = p.K * BITS / 8;
  const int groups = p.K / p.group;
  const float* xs[MC];
  for (int m = 0; m < MC; m++)
    xs[m] = p.x + size_t(m0 + m) * p.K;
  for (int n = n0; n < n1; n++) {
    const uint8_t* wrow = p.w + size_t(n) * row_bytes;
    const float* srow = p.scales + size_t(n) * groups;
    const float* brow = p.biases + size_t(n) * groups;
    __m256 acc[MC][2];
    for (int m = 0; m < MC; m++)
      acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
      const __m256 s = _mm256_set1_ps(srow[g]);
      const __m256 b = _mm256_set1_ps(brow[g]);
      const int kend = (g + 1) * p.group;
      for (int k0 = g * p.group; k0 < kend; k0 += 32) {
        __m256 w[4];
        dequant32_avx2<BITS>(wrow, k0, s, b, w);
        for (int m = 0; m < MC; m++) {
          const float* xr = xs[m] + k0;
          acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[m][1]);
          acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[m][1]);
        }
      }
    }
    for (int m = 0; m < MC; m++)
      p.y[size_t(m0 + m) * p.N + n] = hsum256(_mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

template <int BITS>
void kernel_avx2(const Problem& p, int n0, int n1) {
  for_row_blocks(p, BITS, n0, n1, [&](auto mc, int m, int c0, int c1) {
    block_avx2<BITS, decltype(mc)::value>(p, m, c0, c1);
  });
}

#endif

// Activations rounded to int8 per block of 32 (llama.cpp's Q8 scheme for its
// Q4/Q8 dot products, ggml-quants.c `quantize_row_q8_1`): x ~= d * q with
// d = max|x| / 127 per block. The weight-group bias term uses the rounded
// sums (d * sum q), so the result is exactly the float product with the
// rounded x (what the tests compare with).
struct QuantX {
  std::vector<int8_t> q; // [M, K]; 4-bit weights: each block in nibble order
  std::vector<float> d; // [M, K / 32]
  std::vector<float> gsum; // [M, K / group]: sum of the rounded x per weight group
};

void quantize_x(const Problem& p, QuantX& out) {
  const int blocks = p.K / 32, groups = p.K / p.group;
  out.q.resize(size_t(p.M) * p.K);
  out.d.resize(size_t(p.M) * blocks);
  out.gsum.assign(size_t(p.M) * groups, 0.0f);
  for (int m = 0; m < p.M; m++) {
    for (int b = 0; b < blocks; b++) {
      const float* xb = p.x + size_t(m) * p.K + b * 32;
      float amax = 0;
      for (int i = 0; i < 32; i++)
        amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float inv = d > 0 ? 1.0f / d : 0.0f;
      int8_t* qb = out.q.data() + size_t(m) * p.K + b * 32;
      int sum = 0;
      for (int i = 0; i < 32; i++) {
        const int v = std::clamp(int(std::nearbyint(xb[i] * inv)), -127, 127);
        // 4-bit weights unpack as [low nibbles | high nibbles] = elements
        // [0, 2, ..., 30 | 1, 3, ..., 31]; x is stored in that order.
        const int j = p.bits == 4 ? (i % 2 == 0 ? i / 2 : 16 + i / 2) : i;
        qb[j] = int8_t(v);
        sum += v;
      }
      out.d[size_t(m) * blocks + b] = d;
      out.gsum[size_t(m) * groups + (b * 32) / p.group] += d * float(sum);
    }
  }
}

#if defined(__x86_64__)
// One block of 32 weights (block `kb` of row `wrow`, group scale `s`) against
// the rounded x of MC rows, accumulated into acc[0..MC).
template <int BITS, int MC>
__attribute__((target("avx2,fma"), always_inline)) inline void q8_block(
    const uint8_t* wrow,
    int kb,
    float s,
    const int8_t* const* xq,
    const float* const* xd,
    __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i wv, wabs;
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + kb * 16));
    wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    wabs = wv;
  } else {
    // q - 128 as int8; its magnitude as the unsigned operand, its sign moved
    // onto x (llama.cpp's mul_sum_i8_pairs).
    wv = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + kb * 32)),
        _mm256_set1_epi8(char(0x80)));
    wabs = _mm256_sign_epi8(wv, wv);
  }
  for (int m = 0; m < MC; m++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + kb * 32));
    __m256i prod;
    if constexpr (BITS == 4)
      prod = _mm256_maddubs_epi16(wabs, xv);
    else
      prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv));
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
    acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s * xd[m][kb]), acc[m]);
  }
}

// Rows [m0, m0 + MC) of the rounded x against weight rows [n0, n1), with
// integer dot products of 32 weights at a time (`maddubs`: u8 x i8 pairs
// into i16, then i32), scaled by scale * d per block. Even and odd blocks
// go to separate accumulators so consecutive FMAs do not wait on each other.
// PG: blocks of 32 per weight group (1, 2 or 4 for groups of 32, 64, 128, so
// the group index is a shift), 0 for any other group size (a division).
template <int BITS, int MC, int PG>
__attribute__((target("avx2,fma"))) void
block_q8_avx2(const Problem& p, const QuantX& qx, int m0, int n0, int n1) {
  const int row_bytes = p.K * BITS / 8;
  const int groups = p.K / p.group, blocks = p.K / 32;
  const int per_group = PG > 0 ? PG : p.group / 32;
  const int8_t* xq[MC];
  const float* xd[MC];
  const float* xs[MC];
  for (int m = 0; m < MC; m++) {
    xq[m] = qx.q.data() + size_t(m0 + m) * p.K;
    xd[m] = qx.d.data() + size_t(m0 + m) * blocks;
    xs[m] = qx.gsum.data() + size_t(m0 + m) * groups;
  }
  for (int n = n0; n < n1; n++) {
    const uint8_t* wrow = p.w + size_t(n) * row_bytes;
    const float* srow = p.scales + size_t(n) * groups;
    const float* brow = p.biases + size_t(n) * groups;
    __m256 even[MC], odd[MC];
    for (int m = 0; m < MC; m++)
      even[m] = odd[m] = _mm256_setzero_ps();
    // Software prefetch of the weight rows a few rows ahead (one line per
    // 64 bytes): measured faster than the hardware prefetcher alone here.
    const uint8_t* ahead = wrow + size_t(kPrefetchRows) * row_bytes;
    for (int off = 0; off < row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    int kb = 0;
    for (; kb + 2 <= blocks; kb += 2) {
      q8_block<BITS, MC>(wrow, kb, srow[kb / per_group], xq, xd, even);
      q8_block<BITS, MC>(wrow, kb + 1, srow[(kb + 1) / per_group], xq, xd, odd);
    }
    if (kb < blocks)
      q8_block<BITS, MC>(wrow, kb, srow[kb / per_group], xq, xd, even);
    for (int m = 0; m < MC; m++) {
      // The groups' bias terms: bias * sum(x) (8-bit: bias + 128 * scale,
      // for the q - 128 above).
      float bias_term = 0;
      for (int g = 0; g < groups; g++) {
        const float b = BITS == 4 ? brow[g] : brow[g] + 128.0f * srow[g];
        bias_term += b * xs[m][g];
      }
      p.y[size_t(m0 + m) * p.N + n] = hsum256(_mm256_add_ps(even[m], odd[m])) + bias_term;
    }
  }
}

template <int BITS>
void kernel_q8_avx2(const Problem& p, const QuantX& qx, int n0, int n1) {
  with_blocks_per_group(p.group, [&](auto pg) {
    for_row_blocks(p, BITS, n0, n1, [&](auto mc, int m, int c0, int c1) {
      block_q8_avx2<BITS, decltype(mc)::value, decltype(pg)::value>(p, qx, m, c0, c1);
    });
  });
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

#if defined(__x86_64__)
// AVX-512 float32 kernel. For 4-bit weights, x is first permuted per block of
// 32 into the order the nibbles unpack in ([elements 0, 2, ..., 30 | 1, 3,
// ..., 31]), so a block is two 16-wide conversions with no interleaving.
// Exact in float32 (the same products as dequantize-then-dot).
template <int BITS, int MC, int PG>
__attribute__((target("avx512f"))) void
block_f512(const Problem& p, const float* xp, int m0, int n0, int n1) {
  const int row_bytes = p.K * BITS / 8;
  const int groups = p.K / p.group, blocks = p.K / 32;
  const int per_group = PG > 0 ? PG : p.group / 32;
  const float* xs[MC];
  for (int m = 0; m < MC; m++)
    xs[m] = xp + size_t(m0 + m) * p.K;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int n = n0; n < n1; n++) {
    const uint8_t* wrow = p.w + size_t(n) * row_bytes;
    const float* srow = p.scales + size_t(n) * groups;
    const float* brow = p.biases + size_t(n) * groups;
    const uint8_t* ahead = wrow + size_t(kPrefetchRows) * row_bytes;
    for (int off = 0; off < row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    __m512 acc_a[MC], acc_b[MC];
    for (int m = 0; m < MC; m++)
      acc_a[m] = acc_b[m] = _mm512_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
      const int g = kb / per_group;
      const __m512 s = _mm512_set1_ps(srow[g]);
      const __m512 b = _mm512_set1_ps(brow[g]);
      __m512 w0, w1;
      if constexpr (BITS == 4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + kb * 16));
        w0 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4))), s, b);
        w1 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4))),
            s,
            b);
      } else {
        const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + kb * 32));
        const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + kb * 32 + 16));
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v0)), s, b);
        w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v1)), s, b);
      }
      for (int m = 0; m < MC; m++) {
        const float* xr = xs[m] + kb * 32;
        acc_a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc_a[m]);
        acc_b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc_b[m]);
      }
    }
    for (int m = 0; m < MC; m++)
      p.y[size_t(m0 + m) * p.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_a[m], acc_b[m]));
  }
}

template <int BITS>
void kernel_f512(const Problem& p, const float* xp, int n0, int n1) {
  with_blocks_per_group(p.group, [&](auto pg) {
    for_row_blocks(p, BITS, n0, n1, [&](auto mc, int m, int c0, int c1) {
      block_f512<BITS, decltype(mc)::value, decltype(pg)::value>(p, xp, m, c0, c1);
    });
  });
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

// x [M, K] with each block of 32 in the order 4-bit weights unpack in (see
// block_f512); 8-bit weights read x as it is.
void permute_x_for_nibbles(const Problem& p, std::vector<float>& out) {
  out.resize(size_t(p.M) * p.K);
  for (size_t b = 0; b < size_t(p.M) * p.K; b += 32) {
    for (int i = 0; i < 32; i++)
      out[b + (i % 2 == 0 ? i / 2 : 16 + i / 2)] = p.x[b + i];
  }
}

// Which code computes decode-sized products (`mlxhost_quantized_matmul`'s
// `variant`).
enum Variant { kInt8 = 0, kPortable = 1, kFloat = 2, kFloatAvx2 = 3 };

bool has_simd() {
#if defined(__x86_64__)
  return cpu_has_avx2();
#else
  return false;
#endif
}

void kernel(
    const Problem& p,
    const QuantX* qx,
    const float* xp,
    int n0,
    int n1,
    int variant) {
#if defined(__x86_64__)
  if (variant == kFloat && xp) {
    if (p.bits == 4)
      kernel_f512<4>(p, xp, n0, n1);
    else
      kernel_f512<8>(p, xp, n0, n1);
    return;
  }
  if (variant == kInt8 && qx) {
    if (p.bits == 4)
      kernel_q8_avx2<4>(p, *qx, n0, n1);
    else
      kernel_q8_avx2<8>(p, *qx, n0, n1);
    return;
  }
  if ((variant == kFloat || variant == kFloatAvx2) && cpu_has_avx2()) {
    if (p.bits == 4)
      kernel_avx2<4>(p, n0, n1);
    else
      kernel_avx2<8>(p, n0, n1);
    return;
  }
#endif
  (void)qx;
  (void)variant;
  kernel_portable(p, n0, n1);
}

// Weight rows [n0, n1) dequantized into `out` ([n1 - n0, K] float32).
void dequant_rows(const Problem& p, int n0, int n1, float* out) {
  const int row_bytes = p.K * p.bits / 8;
  const int groups = p.K / p.group;
  for (int n = n0; n < n1; n++) {
    const uint8_t* wrow = p.w + size_t(n) * row_bytes;
    float* o = out + size_t(n - n0) * p.K;
    for (int g = 0; g < groups; g++) {
      const float s = p.scales[size_t(n) * groups + g];
      const float b = p.biases[size_t(n) * groups + g];
      for (int k0 = g * p.group; k0 < (g + 1) * p.group; k0 += 32)
        dequant32(p, wrow, k0, s, b, o + k0);
    }
  }
}

// Splits [0, N) into tasks of whole output rows for the pool.
void parallel_rows(
    int N,
    int min_rows,
    const std::function<void(int, int)>& body,
    bool spin_after = true) {
  Pool& pool = Pool::get();
  const int threads = pool.threads();
  int tasks = std::min(threads * 4, std::max(1, N / std::max(1, min_rows)));
  const int per = (N + tasks - 1) / tasks;
  tasks = (N + per - 1) / per;
  pool.run(tasks, [&](int t) {
    const int n0 = t * per;
    const int n1 = std::min(N, n0 + per);
    if (n0 < n1)
      body(n0, n1);
  }, spin_after);
}

// Prefill-sized `y [M, N] = x [M, K] @ W^T`: tiles of W rows of up to
// `MLXHOST_PREFILL_TILE_MIB` (default 8) MiB as float32, dequantized by the
// pool (`dequant(n0, n1, out)` writes rows [n0, n1) of W), multiplied by
// BLAS. Large tiles: each tile costs a pool wake-up and a BLAS call on fewer
// columns; 1 MiB tiles made SmolLM2's prefill ~18% slower than the float32
// path.
void prefill_blas(
    const float* x,
    float* y,
    int M,
    int N,
    int K,
    const std::function<void(int, int, float*)>& dequant) {
  static const size_t tile_bytes = [] {
    const char* env = std::getenv("MLXHOST_PREFILL_TILE_MIB");
    const int mib = env ? std::max(1, std::atoi(env)) : 8;
    return size_t(mib) << 20;
  }();
  const int tile = std::max(16, int(tile_bytes / (sizeof(float) * size_t(K))));
  // Kept between calls (per thread): a fresh multi-MiB buffer per product
  // pays its page faults again every time.
  static thread_local std::vector<float> buf;
  if (buf.size() < size_t(std::min(tile, N)) * K)
    buf.resize(size_t(std::min(tile, N)) * K);
  // The pool's workers see their own `buf`: hand them this thread's storage.
  float* const tile_buf = buf.data();
  for (int t0 = 0; t0 < N; t0 += tile) {
    const int t1 = std::min(N, t0 + tile);
    parallel_rows(
        t1 - t0,
        4,
        [&](int a, int b) { dequant(t0 + a, t0 + b, tile_buf + size_t(a) * K); },
        false);
    cblas_sgemm(
        kCblasRowMajor,
        kCblasNoTrans,
        kCblasTrans,
        M,
        t1 - t0,
        K,
        1.0f,
        x,
        K,
        tile_buf,
        K,
        0.0f,
        y + t0,
        N);
  }
}

void compute(const Problem& p, int variant) {
  if (p.M <= kMaxKernelRows) {
    QuantX qx;
    const bool int8 = variant == kInt8 && has_simd();
    if (int8)
      quantize_x(p, qx);
    // AVX-512 float: x in the 4-bit unpack order (8-bit: as it is).
    std::vector<float> permuted;
    const float* xp = nullptr;
#if defined(__x86_64__)
    if (variant == kFloat && cpu_has_avx512()) {
      if (p.bits == 4) {
        permute_x_for_nibbles(p, permuted);
        xp = permuted.data();
      } else {
        xp = p.x;
      }
    }
#endif
    parallel_rows(p.N, 8, [&](int n0, int n1) {
      kernel(p, int8 ? &qx : nullptr, xp, n0, n1, variant);
    });
    return;
  }
  prefill_blas(p.x, p.y, p.M, p.N, p.K, [&](int n0, int n1, float* out) {
    dequant_rows(p, n0, n1, out);
  });
}

void parallel_for(int n, const std::function<void(int)>& fn) {
  Pool::get().run(n, fn);
}

void parallel_for_range(int n, int min, const std::function<void(int, int)>& body) {
  parallel_rows(n, min, body);
}

void compute_packed(const PackedProblem& p, int variant) {
  if (p.M <= kMaxKernelRows) {
    compute_packed_tiles(p, variant);
    return;
  }
  const int products = variant == kPackedInt8 ? kPrefillInt8
      : variant == kPackedBf16              ? kPrefillBf16
      : variant == kPackedSimd              ? prefill_products()
                                            : kPrefillFloat;
  if (products == kPrefillBf16 && compute_packed_amx(p))
    return;
  if (products != kPrefillFloat && packed_available()) {
    compute_packed_int8(p);
    return;
  }
  // Prefill: column blocks of W^T (whole 16-row tiles, up to
  // `MLXHOST_PREFILL_TILE_MIB` as float32) dequantized by the pool straight
  // from the tile layout (one vector per element position, no shuffles),
  // then BLAS with B untransposed.
  static const size_t tile_bytes = [] {
    const char* env = std::getenv("MLXHOST_PREFILL_TILE_MIB");
    const int mib = env ? std::max(1, std::atoi(env)) : 8;
    return size_t(mib) << 20;
  }();
  const int tiles_per_block =
      std::max(1, int(tile_bytes / (sizeof(float) * size_t(p.K) * 16)));
  const int tiles = (p.N + 15) / 16;
  const int width = std::min(tiles, tiles_per_block) * 16;
  static thread_local std::vector<float> buf;
  if (buf.size() < size_t(width) * p.K)
    buf.resize(size_t(width) * p.K);
  float* const cols = buf.data();
  for (int t0 = 0; t0 < tiles; t0 += tiles_per_block) {
    const int t1 = std::min(tiles, t0 + tiles_per_block);
    const int ld = (t1 - t0) * 16;
    parallel_rows(
        t1 - t0,
        1,
        [&](int a, int b) { dequant_packed_cols(p, t0 + a, t0 + b, cols + size_t(a) * 16, ld); },
        false);
    const int n0 = t0 * 16, n1 = std::min(p.N, t1 * 16);
    cblas_sgemm(
        kCblasRowMajor,
        kCblasNoTrans,
        kCblasNoTrans,
        p.M,
        n1 - n0,
        p.K,
        1.0f,
        p.x,
        p.K,
        cols,
        ld,
        0.0f,
        p.y + n0,
        p.N);
  }
}

int threads() {
  return Pool::get().threads();
}

} // namespace mlxhost_cpu

namespace {

// The set-up every one-output CPU primitive here shares: refuses inputs that
// are not row-contiguous (the kernels index raw buffers), allocates `out`,
// registers the arrays with the stream's CPU encoder and dispatches `work`
// on it. `what` names the op in the error.
template <class Work>
void dispatch_one_output(
    const char* what,
    mx::Stream s,
    const std::vector<mx::array>& inputs,
    mx::array& out,
    Work&& work) {
  for (const auto& a : inputs) {
    if (!a.flags().row_contiguous)
      throw std::runtime_error(std::string(what) + ": an input is not row-contiguous");
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(s);
  for (const auto& a : inputs)
    enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch(std::forward<Work>(work));
}

using mlxhost_cpu::Problem;

class CpuQuantizedMatmul : public mx::Primitive {
 public:
  CpuQuantizedMatmul(mx::Stream s, int bits, int group, int variant)
      : mx::Primitive(s), bits_(bits), group_(group), variant_(variant) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    dispatch_one_output("quantized matmul", stream(), inputs, out, [inputs, out, bits = bits_, group = group_, variant = variant_]() mutable {
      const auto& x = inputs[0];
      const auto& w = inputs[1];
      Problem p;
      p.x = x.data<float>();
      p.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
      p.scales = inputs[2].data<float>();
      p.biases = inputs[3].data<float>();
      p.y = out.data<float>();
      p.K = x.shape(-1);
      p.M = int(x.size() / std::max<size_t>(1, size_t(p.K)));
      p.N = w.shape(0);
      p.bits = bits;
      p.group = group;
      mlxhost_cpu::compute(p, variant);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost CpuQuantizedMatmul has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostCpuQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuQuantizedMatmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && variant_ == o.variant_;
  }

 private:
  int bits_, group_;
  int variant_;
};

} // namespace

// Builds `y = x @ W^T` lazily. x: [..., K] float32; w: [N, K * bits / 32]
// uint32; scales, biases: [N, K / group] float32; bits 4 or 8; group a
// multiple of 32 dividing K. `out` gets [..., N] float32. `variant` picks the
// decode-sized kernel: 0 int8-rounded activations with integer dot products
// (AVX2; the portable float loop without it), 1 the portable float loop,
// 2 float32 activations with the widest SIMD the CPU has (AVX-512, else
// AVX2 + FMA, else portable), 3 float32 with AVX2 + FMA (for tests). Returns 0, or 1 with the error reported
// through mlx-c's error handler.
extern "C" int mlxhost_quantized_matmul(
    mlx_array* out,
    const mlx_array x,
    const mlx_array w,
    const mlx_array scales,
    const mlx_array biases,
    int bits,
    int group,
    int variant) {
  try {
    const auto& xa = mlx_array_get_(x);
    const auto& wa = mlx_array_get_(w);
    const auto& sa = mlx_array_get_(scales);
    const auto& ba = mlx_array_get_(biases);
    if (bits != 4 && bits != 8)
      throw std::invalid_argument("quantized matmul: bits must be 4 or 8");
    if (group <= 0 || group % 32 != 0)
      throw std::invalid_argument("quantized matmul: the group size must be a multiple of 32");
    if (xa.ndim() < 1 || wa.ndim() != 2 || sa.ndim() != 2 || ba.ndim() != 2)
      throw std::invalid_argument("quantized matmul: x must be [..., K], w/scales/biases 2-d");
    const int K = xa.shape(-1);
    const int N = wa.shape(0);
    if (K % group != 0 || int64_t(wa.shape(1)) * 32 != int64_t(K) * bits ||
        sa.shape(0) != N || ba.shape(0) != N || sa.shape(1) != K / group ||
        ba.shape(1) != K / group) {
      throw std::invalid_argument("quantized matmul: weight, scales or biases do not fit x's width");
    }
    if (xa.dtype() != mx::float32 || wa.dtype() != mx::uint32 || sa.dtype() != mx::float32 ||
        ba.dtype() != mx::float32) {
      throw std::invalid_argument(
          "quantized matmul: x, scales and biases must be float32 and w uint32");
    }
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs = {
        mx::contiguous(xa, false, stream), mx::contiguous(wa, false, stream),
        mx::contiguous(sa, false, stream), mx::contiguous(ba, false, stream)};
    auto shape = xa.shape();
    shape.back() = N;
    auto prim = std::make_shared<CpuQuantizedMatmul>(stream, bits, group, variant);
    mlx_array_set_(*out, mx::array(std::move(shape), mx::float32, prim, std::move(inputs)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

namespace {

using mlxhost_cpu::PackedProblem;

// `y = x @ W^T` from a packed weight (packed_matmul.cpp's layout).
class CpuPackedMatmul : public mx::Primitive {
 public:
  CpuPackedMatmul(mx::Stream s, int n, int bits, int group, bool f16, int variant)
      : mx::Primitive(s), n_(n), bits_(bits), group_(group), f16_(f16), variant_(variant) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    dispatch_one_output("packed matmul", stream(), inputs, out, [inputs, out, n = n_, bits = bits_, group = group_, f16 = f16_,
                  variant = variant_]() mutable {
      const auto& x = inputs[0];
      PackedProblem p;
      p.x = x.data<float>();
      p.packed = inputs[1].data<uint8_t>();
      p.y = out.data<float>();
      p.K = x.shape(-1);
      p.M = int(x.size() / std::max<size_t>(1, size_t(p.K)));
      p.N = n;
      p.bits = bits;
      p.group = group;
      p.f16_scales = f16;
      mlxhost_cpu::compute_packed(p, variant);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost CpuPackedMatmul has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostCpuPackedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuPackedMatmul&>(other);
    return n_ == o.n_ && bits_ == o.bits_ && group_ == o.group_ && f16_ == o.f16_ &&
        variant_ == o.variant_;
  }

 private:
  int n_, bits_, group_;
  bool f16_;
  int variant_;
};

// Rows of a packed weight gathered by id and dequantized to float32: the
// embedding lookup of a packed table (the tied output head then streams the
// packed layout too, and the table is held once).
class CpuPackedRows : public mx::Primitive {
 public:
  CpuPackedRows(mx::Stream s, int n, int k, int bits, int group, bool f16)
      : mx::Primitive(s), n_(n), k_(k), bits_(bits), group_(group), f16_(f16) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    dispatch_one_output("packed rows", stream(), inputs, out, [inputs, out, n = n_, k = k_, bits = bits_, group = group_,
                  f16 = f16_]() mutable {
      PackedProblem p{};
      p.packed = inputs[1].data<uint8_t>();
      p.N = n;
      p.K = k;
      p.bits = bits;
      p.group = group;
      p.f16_scales = f16;
      const uint32_t* ids = inputs[0].data<uint32_t>();
      float* y = out.data<float>();
      for (size_t i = 0; i < inputs[0].size(); i++) {
        // An id past the table (the host checks ids against the
        // vocabulary first) reads nothing: a zero row.
        if (ids[i] >= uint32_t(n))
          std::fill(y + i * k, y + (i + 1) * k, 0.0f);
        else
          mlxhost_cpu::dequant_packed_rows(p, int(ids[i]), int(ids[i]) + 1, y + i * k);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost CpuPackedRows has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostCpuPackedRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuPackedRows&>(other);
    return n_ == o.n_ && k_ == o.k_ && bits_ == o.bits_ && group_ == o.group_ && f16_ == o.f16_;
  }

 private:
  int n_, k_, bits_, group_;
  bool f16_;
};

} // namespace

// Whether this CPU runs the packed layout's SIMD kernel (AVX-512 VNNI).
extern "C" int mlxhost_packed_available() {
  return mlxhost_cpu::packed_available() ? 1 : 0;
}

// Repacks an MLX affine weight (w [N, K * bits / 32] uint32, scales and
// biases [N, K / group] float32; bits 4 or 8, group 32, 64 or 128) into the
// packed layout, eagerly (load time): `out` gets [ceil(N / 16), bytes per
// tile] uint8, `f16` whether scales and biases were stored as float16 (only
// when that is lossless). Returns 0, or 1 with the error reported through
// mlx-c's error handler.
extern "C" int mlxhost_pack_quantized(
    mlx_array* out,
    int* f16,
    const mlx_array w,
    const mlx_array scales,
    const mlx_array biases,
    int bits,
    int group) {
  try {
    auto wa = mlx_array_get_(w);
    auto sa = mlx_array_get_(scales);
    auto ba = mlx_array_get_(biases);
    if (bits != 4 && bits != 8)
      throw std::invalid_argument("pack: bits must be 4 or 8");
    // Integer group sums stay below 2^31 up to 128 elements (8-bit codes
    // times int8 digits of x).
    if (group != 32 && group != 64 && group != 128)
      throw std::invalid_argument("pack: the group size must be 32, 64 or 128");
    if (wa.ndim() != 2 || sa.ndim() != 2 || ba.ndim() != 2 || wa.dtype() != mx::uint32 ||
        sa.dtype() != mx::float32 || ba.dtype() != mx::float32)
      throw std::invalid_argument("pack: w must be 2-d uint32, scales and biases 2-d float32");
    const int N = wa.shape(0);
    const int K = int(int64_t(wa.shape(1)) * 32 / bits);
    if (K % group != 0 || sa.shape(0) != N || ba.shape(0) != N || sa.shape(1) != K / group ||
        ba.shape(1) != K / group)
      throw std::invalid_argument("pack: scales or biases do not fit the weight");
    auto cpu = mx::default_stream(mx::Device::cpu);
    wa = mx::contiguous(wa, false, cpu);
    sa = mx::contiguous(sa, false, cpu);
    ba = mx::contiguous(ba, false, cpu);
    mx::eval({wa, sa, ba});
    const bool half = mlxhost_cpu::scales_fit_f16(
        sa.data<float>(), ba.data<float>(), size_t(N) * (K / group));
    const size_t bytes = mlxhost_cpu::packed_bytes(N, K, bits, group, half);
    const int tiles = (N + 15) / 16;
    auto buf = mx::allocator::malloc(bytes);
    uint8_t* dst = static_cast<uint8_t*>(buf.raw_ptr());
    const uint8_t* src = reinterpret_cast<const uint8_t*>(wa.data<uint32_t>());
    const float* sp = sa.data<float>();
    const float* bp = ba.data<float>();
    const size_t tile_bytes = bytes / size_t(tiles);
    // Tiles are independent: pack them on the pool (16 rows of input each).
    mlxhost_cpu::parallel_for_range(tiles, 8, [&](int t0, int t1) {
      const int n0 = t0 * 16, n1 = std::min(N, t1 * 16);
      mlxhost_cpu::pack(
          src + size_t(n0) * K * bits / 8,
          sp + size_t(n0) * (K / group),
          bp + size_t(n0) * (K / group),
          n1 - n0,
          K,
          bits,
          group,
          half,
          dst + size_t(t0) * tile_bytes);
    });
    *f16 = half ? 1 : 0;
    mlx_array_set_(
        *out,
        mx::array(
            buf,
            mx::Shape{tiles, int(tile_bytes)},
            mx::uint8,
            mx::allocator::free));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// Throws unless `pa` is `mlxhost_pack_quantized`'s array for an [n, k]
// weight of `bits` and `group` (float16 scales when `f16`); `what` names
// the caller in the message.
static void check_packed_weight(
    const mx::array& pa, int n, int k, int bits, int group, int f16, const char* what) {
  if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) || k <= 0 ||
      k % group != 0 || n <= 0)
    throw std::invalid_argument(std::string(what) + ": unsupported bits, group or width");
  const size_t bytes = mlxhost_cpu::packed_bytes(n, k, bits, group, f16 != 0);
  if (pa.dtype() != mx::uint8 || pa.ndim() != 2 || pa.shape(0) != (n + 15) / 16 ||
      size_t(pa.shape(0)) * size_t(pa.shape(1)) != bytes)
    throw std::invalid_argument(std::string(what) + ": the packed weight does not fit its shape");
}

// The inverse of `mlxhost_pack_quantized`, eagerly: a packed weight of `n`
// rows and width `k` back to MLX's affine arrays (`w` [n, k * bits / 32]
// uint32, `scales`/`biases` [n, k / group] float32), exactly. Returns 0, or
// 1 with the error reported through mlx-c's error handler.
extern "C" int mlxhost_unpack_quantized(
    mlx_array* w,
    mlx_array* scales,
    mlx_array* biases,
    const mlx_array packed,
    int n,
    int k,
    int bits,
    int group,
    int f16) {
  try {
    auto pa = mlx_array_get_(packed);
    check_packed_weight(pa, n, k, bits, group, f16, "unpack");
    pa = mx::contiguous(pa, false, mx::default_stream(mx::Device::cpu));
    mx::eval({pa});
    std::vector<uint32_t> wv(size_t(n) * (k * bits / 32));
    std::vector<float> sv(size_t(n) * (k / group)), bv(sv.size());
    mlxhost_cpu::unpack(
        pa.data<uint8_t>(), n, k, bits, group, f16 != 0, wv.data(), sv.data(), bv.data());
    mlx_array_set_(*w, mx::array(wv.begin(), mx::Shape{n, k * bits / 32}, mx::uint32));
    mlx_array_set_(*scales, mx::array(sv.begin(), mx::Shape{n, k / group}, mx::float32));
    mlx_array_set_(*biases, mx::array(bv.begin(), mx::Shape{n, k / group}, mx::float32));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// Builds `y = x @ W^T` lazily from a packed weight (`mlxhost_pack_quantized`).
// x: [..., K] float32; `out` gets [..., n] float32. `variant`: 0 the SIMD
// kernel where the CPU has it, 1 the portable loop, 2 int8 and 3 bfloat16
// prefill products (tests; cpu_kernels.h's kPacked*). Returns 0, or 1
// with the error reported through mlx-c's error handler.
extern "C" int mlxhost_packed_matmul(
    mlx_array* out,
    const mlx_array x,
    const mlx_array packed,
    int n,
    int bits,
    int group,
    int f16,
    int variant) {
  try {
    const auto& xa = mlx_array_get_(x);
    const auto& pa = mlx_array_get_(packed);
    if (xa.ndim() < 1 || xa.dtype() != mx::float32)
      throw std::invalid_argument("packed matmul: x must be [..., K] float32");
    const int K = xa.shape(-1);
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) ||
        K % group != 0 || n <= 0)
      throw std::invalid_argument("packed matmul: unsupported bits, group or width");
    const size_t bytes = mlxhost_cpu::packed_bytes(n, K, bits, group, f16 != 0);
    if (pa.dtype() != mx::uint8 || pa.ndim() != 2 || pa.shape(0) != (n + 15) / 16 ||
        size_t(pa.shape(0)) * size_t(pa.shape(1)) != bytes)
      throw std::invalid_argument("packed matmul: the packed weight does not fit x's width");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs = {
        mx::contiguous(xa, false, stream), mx::contiguous(pa, false, stream)};
    auto shape = xa.shape();
    shape.back() = n;
    auto prim = std::make_shared<CpuPackedMatmul>(stream, n, bits, group, f16 != 0, variant);
    mlx_array_set_(*out, mx::array(std::move(shape), mx::float32, prim, std::move(inputs)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// Builds `out [..., K] = W[ids]` lazily: rows of a packed weight of `n` rows
// and width `k`, dequantized to float32. ids: uint32 of any shape. Returns
// 0, or 1 with the error reported through mlx-c's error handler.
extern "C" int mlxhost_packed_rows(
    mlx_array* out,
    const mlx_array ids,
    const mlx_array packed,
    int n,
    int k,
    int bits,
    int group,
    int f16) {
  try {
    const auto& ia = mlx_array_get_(ids);
    const auto& pa = mlx_array_get_(packed);
    if (ia.dtype() != mx::uint32)
      throw std::invalid_argument("packed rows: ids must be uint32");
    check_packed_weight(pa, n, k, bits, group, f16, "packed rows");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs = {
        mx::contiguous(ia, false, stream), mx::contiguous(pa, false, stream)};
    auto shape = ia.shape();
    shape.push_back(k);
    auto prim = std::make_shared<CpuPackedRows>(stream, n, k, bits, group, f16 != 0);
    mlx_array_set_(*out, mx::array(std::move(shape), mx::float32, prim, std::move(inputs)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// Row count above which the op multiplies through tile dequantization and
// BLAS instead of the packed-weight kernel.
extern "C" int mlxhost_quantized_matmul_max_rows() {
  return mlxhost_cpu::kMaxKernelRows;
}

// Threads the op's pool runs on (the caller included).
extern "C" int mlxhost_cpu_threads() {
  return mlxhost_cpu::threads();
}

// The CPU kernel set OpenBLAS chose at load (`openblas_get_corename`, looked
// up at run time because the BLAS may not be OpenBLAS), or null.
#include <dlfcn.h>
extern "C" const char* mlxhost_blas_corename() {
  using Fn = const char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return fn ? fn() : nullptr;
}
