// CPU kernels of kiln::weight_only_linear, kiln::bf16_linear and kiln::fp32_linear, registered with the dispatcher
// when the native library loads (the op schemas are defined from Python). Calling the kernel from
// C++ instead of a Python kernel saves ~20-40 us of Python per call, which matters at batch-1
// decode (hundreds of linears per step). Anything the native kernels do not cover (kernels
// disabled, large M for bf16, unusual shapes or dtypes, invalid arguments) goes to the Python
// implementation, kiln::_weight_only_linear_py / _bf16_linear_py / _fp32_linear_py, which also owns the
// argument validation and its error messages.

#include "kiln_kernels.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/mm.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>
#include <optional>

namespace {

std::atomic<int> g_enabled{1};

// Largest M (rows of x) each weight kind runs through the kernels, indexed by KILN_W_BF16 .. KILN_W_FP32;
// above it the Python implementation runs torch's sgemm on weights dequantised in row chunks.
// Measured on the project's AVX2 machine (AMD Zen 1, 2 cores), where torch's sgemm reaches 19-68
// GFLOP/s depending on the shape (19 at M=16 with K=1024): the kernels (50-70 GFLOP/s) win for fp32
// weights at every M on the whole model (a 256-token prefill of the 311M Llama: 2.32 s vs 2.43 s
// through sgemm), bf16 up to M ~ 64-128 and int8/int4 at every M tried (up to 256). On a CPU with
// AVX-512/AMX GEMMs, lower these (kiln.plugins.linear.set_kernel_max_m).
constexpr int64_t UNLIMITED = int64_t(1) << 40;
std::atomic<int64_t> g_max_m[KILN_NUM_KINDS] = {{64}, {UNLIMITED}, {UNLIMITED}, {UNLIMITED}};
static_assert(KILN_W_BF16 == 0 && KILN_W_INT8 == 1 && KILN_W_INT4 == 2 && KILN_W_FP32 == 3, "g_max_m's order");

// int4 panels at M >= this (0: never) run as a bf16 GEMM on the weight dequantized once per call
// (kiln_dequant_int4_panel_bf16 + at::mm, oneDNN). On a CPU with AMX-BF16 (Intel Sapphire Rapids, 2 cores) that
// GEMM reaches 1.0-1.2 TFLOP/s at M = 512 against the int4 kernels' 0.4 (vpdpwssd on int16 x); with the dequant
// (0.2-0.7 ms per call for the 246m's shapes) it wins from M ~ 128 and loses at 64 (docs/benchmarks.md);
// without AMX oneDNN's bf16 GEMM is not measured to beat the int4 kernels, so they keep every M. x is rounded to bf16 on this path (error ~2^-9 relative, far below the int4 weight error).
bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 22) & 1u;  // CPUID.(EAX=7,ECX=0):EDX[22] AMX-BF16
}
std::atomic<int64_t> g_int4_gemm_m{cpu_has_amx_bf16() ? 128 : 0};

// bf16 panels with bf16 x at M >= this (0: never; -1: not chosen yet) run as oneDNN bf16 GEMMs (torch's
// cpublas::brgemm, AMX where present) on the panels as they are stored: a panel [K/2, 16, 2] is exactly the
// VNNI-packed B operand of a 16-column GEMM, so nothing is copied or dequantized. Products are exact and sums
// in fp32, as in the panel kernels (vdpbf16ps). From M = 5: the tile kernel streams the weights at the same rate
// at any M (a batched decode is memory-bound), where on Sapphire Rapids the AVX-512 panel kernels fall to half of
// it at 13..15 rows and a whole decode step of 5..15 rows runs faster on the tiles, 4 rows not (docs/benchmarks.md,
// "bf16 batched decode on AMX from 5 rows"); chosen where the CPU has AMX-BF16 and torch's oneDNN brgemm takes bf16,
// else never (the panel kernels keep every M; not measured on a CPU without AMX).
// torch's brgemm takes a bf16 VNNI B operand only through oneDNN's ukernel on AMX: elsewhere it throws, so the
// route exists only where both hold.
bool bf16_gemm_available() {
  static const bool ok = cpu_has_amx_bf16() && at::native::cpublas::could_pack(at::kBFloat16);
  return ok;
}
std::atomic<int64_t> g_bf16_gemm_m{-1};
int64_t bf16_gemm_m() {
  int64_t m = g_bf16_gemm_m.load(std::memory_order_relaxed);
  if (m < 0) {
    m = bf16_gemm_available() ? 5 : 0;
    g_bf16_gemm_m.store(m);
  }
  return m;
}

// fp32 panels with fp32 x at M >= this (0: never; -1: not chosen yet) run on AMX tiles with each operand split into
// two bf16 halves (hi = x rounded to bf16, lo = the remainder rounded): x w ~ hi_x hi_w + hi_x lo_w + lo_x hi_w,
// three exact bf16 products summed in fp32, each operand kept to ~16 significant bits (PyTorch's "high" float32
// matmul precision; TF32 keeps 11): faster than the fp32 kernels from ~40 rows, and the logits further from the
// exact product (docs/benchmarks.md, session 27), so only on request (kiln_ops_set_fp32_gemm_m: the Python loader
// sets it from KILN_FP32_MATMUL=high, kiln.plugins.native), and only where the CPU has AMX-BF16 and the OS grants
// tile state.
std::atomic<int64_t> g_fp32_gemm_m{0};
bool amx_tiles_permitted();
int64_t fp32_gemm_m() { return g_fp32_gemm_m.load(std::memory_order_relaxed); }

// int8 panels with fp32 x take the AMX tile kernel with x split into bf16 halves (hi_x w + lo_x w: the weights are
// exact in bf16, x kept to ~16 significant bits where the int8 kernels round it to int16 with one scale per row) from
// this many rows where int8 panels with bf16 x take the tiles (kiln_ops_int8_amx_m), 0 elsewhere: never below
// INT8_SPLIT_MIN_M, below which the conversions cost more than the tiles gain (docs/benchmarks.md, session 27).
constexpr int64_t INT8_SPLIT_MIN_M = 64;
int64_t int8_split_m() {
  const int64_t m = kiln_ops_int8_amx_m();
  return m > 0 ? std::max(m, INT8_SPLIT_MIN_M) : 0;
}

// Rows of x per brgemm call (measured: 64 beats 32 by 1.1-1.3x at M >= 128).
constexpr int64_t BF16_GEMM_MB = 64;
// Panels whose outputs one brgemm round fills before they are stored as bf16 (64 columns), and rows of x one
// round of a thread's panels sweeps, on both AMX routes (256 rows: 0.5-1.4 MB of x for the 246m's K, kept in L2
// while the panels stream past it once per 256 rows instead of once per block).
constexpr int64_t BF16_GEMM_PB = 4;
constexpr int64_t GEMM_SWEEP_ROWS = 256;

namespace k512 {  // AVX-512 / AMX code, entered only where CPUID reports AMX-BF16 (bf16_gemm_available)
// rows x cols fp32 accumulators (row stride ldc) x scale (per column, int8 weights; none for bf16) + bias -> bf16
// rows of y (row stride ldy), rounded to nearest even as at::Tensor::to does; only called where the CPU has
// AMX-BF16, hence AVX512_BF16.
__attribute__((target("avx512f,avx512bf16,avx512vl")))
void store_bf16_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* scale, const float* bias,
                     at::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * ldc;
    auto* yr = reinterpret_cast<uint16_t*>(y + r * ldy);
    for (int64_t j = 0; j < cols; j += 16) {  // cols is a multiple of KILN_PANEL (16)
      __m512 v = _mm512_loadu_ps(cr + j);
      if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + j));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + j), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// n int8 -> bf16 (exact: |q| <= 128 needs 8 significant bits, bf16 has 8); n a multiple of 16
__attribute__((target("avx512f,avx512bf16,avx512vl")))
void int8_to_bf16(const int8_t* q, int64_t n, at::BFloat16* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// rows x cols fp32 accumulators (row stride ldc) x scale (per column, int8 weights; none for fp32) + bias -> fp32
// rows of y (row stride ldy)
__attribute__((target("avx512f")))
void store_f32_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* scale, const float* bias,
                    float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; j += 16) {
      __m512 v = _mm512_loadu_ps(c + r * ldc + j);
      if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + j));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
      _mm512_storeu_ps(y + r * ldy + j, v);
    }
}

// 16 fp32 -> their bf16 (nearest even) and the bf16 of what that rounding left, each in the low half of a dword
__attribute__((target("avx512f,avx512bf16,avx512vl")))
inline __m512 split16(__m512 v, __m512i& hi, __m512i& lo) {
  hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(rest));
  return rest;
}

// n fp32 (a multiple of 16) -> hi and lo bf16 halves; false when x holds inf or NaN (the remainder is then NaN or
// infinite), which the split cannot carry as the reference does
__attribute__((target("avx512f,avx512bf16,avx512vl")))
bool split_bf16(const float* x, int64_t n, at::BFloat16* hi, at::BFloat16* lo) {
  __mmask16 bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    __m512i h, l;
    const __m512 rest = split16(_mm512_loadu_ps(x + i), h, l);
    const __m512 zero_if_finite = _mm512_sub_ps(rest, rest);
    bad |= _mm512_cmp_ps_mask(zero_if_finite, zero_if_finite, _CMP_UNORD_Q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi32_epi16(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi32_epi16(l));
  }
  return bad == 0;
}

// fp32 panels [panels][K][16] -> hi and lo bf16 panels in the AMX B layout [panels][K/2][16][2] (k pairs
// interleaved per column); K even
__attribute__((target("avx512f,avx512bf16,avx512vl")))
void split_panels(const float* w, int64_t panels, int64_t K, at::BFloat16* hi, at::BFloat16* lo) {
  auto* h32 = reinterpret_cast<int32_t*>(hi);
  auto* l32 = reinterpret_cast<int32_t*>(lo);
  for (int64_t r = 0; r < panels * K; r += 2) {   // rows 2j, 2j+1 of a panel -> dwords (k even | k odd << 16)
    __m512i h0, l0, h1, l1;
    split16(_mm512_loadu_ps(w + r * KILN_PANEL), h0, l0);
    split16(_mm512_loadu_ps(w + (r + 1) * KILN_PANEL), h1, l1);
    _mm512_storeu_si512(h32 + r / 2 * KILN_PANEL, _mm512_or_si512(h0, _mm512_slli_epi32(h1, 16)));
    _mm512_storeu_si512(l32 + r / 2 * KILN_PANEL, _mm512_or_si512(l0, _mm512_slli_epi32(l1, 16)));
  }
}

}  // namespace k512

// y [M, N] = x [M, K] (bf16, contiguous) @ panels^T (+ bias), in x's dtype (bf16). One 16-column brgemm per
// panel and block of 64 rows, into a small fp32 tile that is stored as bf16 at once (no [M, N] fp32 pass);
// threads split blocks of 4 panels; each thread sweeps its blocks over 256 rows of x at a time.
at::Tensor bf16_panel_gemm(const at::Tensor& x2, const at::Tensor& w, const float* bias, int64_t N, int64_t K) {
  const int64_t M = x2.size(0), P = N / KILN_PANEL;
  const int64_t NB = (P + BF16_GEMM_PB - 1) / BF16_GEMM_PB;
  at::Tensor y = at::empty({M, N}, x2.options());
  const auto* xp = static_cast<const at::BFloat16*>(x2.const_data_ptr());
  const auto* wp = static_cast<const at::BFloat16*>(w.const_data_ptr());
  auto* yp = static_cast<at::BFloat16*>(y.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float c[BF16_GEMM_MB * BF16_GEMM_PB * KILN_PANEL];
    for (int64_t s0 = 0; s0 < M; s0 += GEMM_SWEEP_ROWS) {
      const int64_t s1 = std::min(M, s0 + GEMM_SWEEP_ROWS);
      for (int64_t bb = b0; bb < b1; ++bb) {
        const int64_t p0 = bb * BF16_GEMM_PB, np = std::min(BF16_GEMM_PB, P - p0), ldc = np * KILN_PANEL;
        for (int64_t m0 = s0; m0 < s1; m0 += BF16_GEMM_MB) {
          const int64_t mc = std::min(BF16_GEMM_MB, s1 - m0);
          for (int64_t j = 0; j < np; ++j)
            at::native::cpublas::brgemm(mc, KILN_PANEL, K, K, KILN_PANEL, ldc, false, xp + m0 * K,
                                        wp + (p0 + j) * K * KILN_PANEL, c + j * KILN_PANEL, true);
          k512::store_bf16_rows(c, ldc, mc, ldc, nullptr, bias ? bias + p0 * KILN_PANEL : nullptr, yp + m0 * N + p0 * KILN_PANEL, N);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// The same GEMM on AMX tiles directly, where K is a multiple of 32 (one tile of x is 16 rows x 32 k): a panel's
// 16 k-pairs x 16 columns x 2 are exactly one B tile, so each tile of the panels loads in place (1 KB, stride 64 B).
// Blocks of 32 rows x 2 panels keep 4 accumulator tiles, 2 of x and 2 of the panels (all 8), i.e. 2 tile loads per
// tile product against brgemm's ~1.25 at 16 columns a call; measured 1.3-1.6x brgemm's GFLOP/s on the 246m's
// shapes (docs/benchmarks.md). Rows past the last full 32 are copied into a zero-padded block.
// While a sweep's blocks run on one panel pair, the next pair is prefetched into L2, a few lines each step of k
// spread over all of the pair's blocks: its first block then finds its tiles in L2 instead of waiting on memory
// for every one. Only with two or more blocks: with one (decode batches) all of the next pair in one block's steps
// is more prefetching than the memory system takes beside the tile loads (docs/benchmarks.md, session 25).
constexpr int64_t AMX_MR = 32, AMX_KB = 32;

// Linux gives a process AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// false where it refuses (then the brgemm path runs).
bool amx_tiles_permitted() {
  static const bool ok = [] {
    if (!cpu_has_amx_bf16()) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr TileConfig amx_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;  // every tile 16 rows x 64 bytes
  return cfg;
}
// A constant in memory: a config on the stack is not safe, GCC drops its stores as dead (ldtilecfg's read of
// them is invisible to it), and the tile unit then faults on the garbage.
alignas(64) const TileConfig AMX_CONFIG = amx_config();

__attribute__((target("amx-tile,amx-bf16"))) void amx_load_config() { _tile_loadconfig(&AMX_CONFIG); }

__attribute__((target("amx-tile,amx-bf16"))) void amx_release() { _tile_release(); }

// The tile steps of the AMX GEMM kernels below: tiles 0-3 hold a block's 32 x 32 fp32 sums (0 and 2 the first
// panel's columns for rows 0-15 and 16-31, 1 and 3 the second's), 4 and 5 x's rows 0-15 and 16-31, 6 and 7 the
// panel pair's panels (the second `second` elements after the first; only the first when not TWO). Tile numbers are
// literals: GCC's tile intrinsics paste them into the asm text.
#define KILN_AMX_INLINE __attribute__((target("amx-tile,amx-bf16"), always_inline)) inline

KILN_AMX_INLINE void amx_zero_sums() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }

KILN_AMX_INLINE void amx_load_rows(const at::BFloat16* a, int64_t lda) {
  const int64_t stride = lda * int64_t(sizeof(at::BFloat16));
  _tile_loadd(4, a, stride);
  _tile_loadd(5, a + 16 * lda, stride);
}

// sums += rows x the panels already in tiles 6 (and 7)
template <bool TWO>
KILN_AMX_INLINE void amx_products() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(2, 5, 6);
  if (TWO) {
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// sums += rows x the panel pair at b (each panel loaded right before its products)
template <bool TWO>
KILN_AMX_INLINE void amx_pair_products(const at::BFloat16* b, int64_t second) {
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(2, 5, 6);
  if (TWO) {
    _tile_loadd(7, b + second, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// c [32, 32] fp32 (row stride 32) = the sums
template <bool TWO>
KILN_AMX_INLINE void amx_store_sums(float* c) {
  _tile_stored(0, c, 128);
  _tile_stored(2, c + 16 * 32, 128);
  if (TWO) {
    _tile_stored(1, c + 16, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// c [32, 32] fp32 (row stride 32) = a [32, K] (row stride lda elements) @ the panel pair at b (the second panel
// K * 16 on; only the first when not TWO); each step of k also prefetches `lines` cache lines from `ahead` on into
// L2 (none when ahead is null)
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16")))
void amx_block(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t K, float* c, const char* ahead,
               int64_t lines) {
  amx_zero_sums();
  for (int64_t k = 0; k < K; k += AMX_KB) {
    if (ahead != nullptr) {
      for (int64_t l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
      ahead += 64 * lines;
    }
    amx_load_rows(a + k, lda);
    amx_pair_products<TWO>(b + k * KILN_PANEL, K * KILN_PANEL);
  }
  amx_store_sums<TWO>(c);
}

// INT8: w holds int8 panels (the same [N/16, K/2, 16, 2] order) with one fp32 scale per output: each panel pair
// is converted to bf16 (exactly) into a per-thread buffer once per sweep, and the scale applied as it is stored.
template <bool INT8>
at::Tensor panel_gemm_amx(const at::Tensor& x2, const at::Tensor& w, const float* scale, const float* bias, int64_t N,
                          int64_t K) {
  const int64_t M = x2.size(0), P = N / KILN_PANEL, PP = (P + 1) / 2;
  const int64_t full = M / AMX_MR * AMX_MR;
  at::Tensor y = at::empty({M, N}, x2.options());
  const auto* xp = static_cast<const at::BFloat16*>(x2.const_data_ptr());
  const auto* wp = static_cast<const at::BFloat16*>(w.const_data_ptr());
  const auto* qp = static_cast<const int8_t*>(w.const_data_ptr());
  auto* yp = static_cast<at::BFloat16*>(y.data_ptr());
  at::Tensor tail;  // the last M % 32 rows, zero-padded to 32
  if (full < M) {
    tail = at::zeros({AMX_MR, K}, x2.options());
    tail.narrow(0, 0, M - full).copy_(x2.narrow(0, full, M - full));
  }
  const auto* tp = tail.defined() ? static_cast<const at::BFloat16*>(tail.const_data_ptr()) : nullptr;
  // the panels as stored (int8 or bf16) and one panel pair's bytes there: what the next-pair prefetch walks
  const char* stored = static_cast<const char*>(w.const_data_ptr());
  const int64_t pair_bytes = 2 * K * KILN_PANEL * int64_t(INT8 ? sizeof(int8_t) : sizeof(at::BFloat16));
  at::parallel_for(0, PP, 1, [&](int64_t q0, int64_t q1) {
    alignas(64) float c[AMX_MR * 32];
    std::vector<at::BFloat16> converted(INT8 ? 2 * K * KILN_PANEL : 0);
    kiln_amx_tiles_begin();
    for (int64_t s0 = 0; s0 < M; s0 += GEMM_SWEEP_ROWS) {
      const int64_t s1 = std::min(M, s0 + GEMM_SWEEP_ROWS);
      const int64_t blocks = (s1 - s0 + AMX_MR - 1) / AMX_MR, steps = K / AMX_KB;
      const int64_t lines = (pair_bytes / 64 + blocks * steps - 1) / (blocks * steps);   // per step of k
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = 2 * q, cols = (p + 1 < P ? 2 : 1) * KILN_PANEL;
        const at::BFloat16* b0 = wp + p * K * KILN_PANEL;
        // the thread's next panel pair, as stored
        const char* next = blocks >= 2 && q + 1 < q1 ? stored + (q + 1) * pair_bytes : nullptr;
        if (INT8) {
          k512::int8_to_bf16(qp + p * K * KILN_PANEL, cols * K, converted.data());
          b0 = converted.data();
        }
        for (int64_t m0 = s0; m0 < s1; m0 += AMX_MR) {
          const at::BFloat16* a = m0 < full ? xp + m0 * K : tp;
          const char* ahead = next ? next + (m0 - s0) / AMX_MR * steps * lines * 64 : nullptr;
          if (cols == 2 * KILN_PANEL) amx_block<true>(a, K, b0, K, c, ahead, lines);
          else amx_block<false>(a, K, b0, K, c, ahead, lines);
          k512::store_bf16_rows(c, 32, std::min(AMX_MR, M - m0), cols, INT8 ? scale + p * KILN_PANEL : nullptr, bias ? bias + p * KILN_PANEL : nullptr,
                          yp + m0 * N + p * KILN_PANEL, N);
        }
      }
    }
    kiln_amx_tiles_end();
  });
  return y;
}

// c [32, 32] fp32 (row stride 32) = x of 32 rows split into hi and lo halves (ah, al: [32, K], row stride lda) @
// one panel pair split the same way (bh, bl: [2][K/2][16][2], the second panel K * 16 on; only the first when not
// TWO): hi_x lo_w + hi_x hi_w + lo_x hi_w, summed over k
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16")))
void amx_block_split(const at::BFloat16* ah, const at::BFloat16* al, int64_t lda, const at::BFloat16* bh,
                     const at::BFloat16* bl, int64_t K, float* c) {
  amx_zero_sums();
  const int64_t second = K * KILN_PANEL;
  for (int64_t k = 0; k < K; k += AMX_KB) {
    const int64_t kb = k * KILN_PANEL;
    amx_load_rows(ah + k, lda);
    amx_pair_products<TWO>(bl + kb, second);
    amx_pair_products<TWO>(bh + kb, second);
    amx_load_rows(al + k, lda);
    amx_products<TWO>();   // hi_w still in tiles 6 and 7
  }
  amx_store_sums<TWO>(c);
}

// c [32, 32] fp32 (row stride 32) = x of 32 rows split into hi and lo halves (ah, al) @ one panel pair of bf16 that
// holds the weights exactly (int8 panels converted): hi_x w + lo_x w
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16")))
void amx_block_xsplit(const at::BFloat16* ah, const at::BFloat16* al, int64_t lda, const at::BFloat16* b, int64_t K,
                      float* c) {
  amx_zero_sums();
  for (int64_t k = 0; k < K; k += AMX_KB) {
    amx_load_rows(ah + k, lda);
    amx_pair_products<TWO>(b + k * KILN_PANEL, K * KILN_PANEL);
    amx_load_rows(al + k, lda);
    amx_products<TWO>();   // w still in tiles 6 and 7
  }
  amx_store_sums<TWO>(c);
}

// Rows of x one sweep of a thread's panel pairs covers on the split route: x's two halves take 4 bytes a k, as
// much as the bf16 route's 256 rows at 2 bytes, so this keeps the same bytes in L2.
constexpr int64_t SPLIT_SWEEP_ROWS = 128;
// A thread's split panels kept across sweeps (one conversion per call) are dropped after a call past this size.
constexpr size_t SPLIT_KEEP_BYTES = size_t(64) << 20;

// y [M, N] fp32 = x [M, K] fp32 @ panels^T (+ bias) on AMX tiles with x split into bf16 halves: fp32 panels
// [N/16, K, 16] split into halves too (fp32_gemm_m), or (INT8) int8 panels converted to bf16, exactly, with one
// scale per output applied as they are stored (int8_split_m). Each thread splits a sweep's rows of x itself (a small
// buffer instead of a copy of all of x, for a few % more conversion) and converts its panel pairs once per call into
// the AMX B layout, kept for the later sweeps when there are any. Undefined when x holds inf or NaN (the caller's
// kernels then carry them as the reference does).
template <bool INT8>
at::Tensor panel_gemm_amx_split(const at::Tensor& x2, const at::Tensor& w, const float* scale, const float* bias,
                                int64_t N, int64_t K) {
  const int64_t M = x2.size(0), P = N / KILN_PANEL, PP = (P + 1) / 2;
  at::Tensor y = at::empty({M, N}, x2.options());
  const auto* xp = static_cast<const float*>(x2.const_data_ptr());
  const auto* wp = static_cast<const float*>(w.const_data_ptr());
  const auto* qp = static_cast<const int8_t*>(w.const_data_ptr());
  auto* yp = static_cast<float*>(y.data_ptr());
  const int64_t pair = 2 * K * KILN_PANEL;   // bf16 elements of a panel pair (of one half, when split)
  const int64_t parts = INT8 ? 1 : 2;
  const bool keep = M > SPLIT_SWEEP_ROWS;
  std::atomic<bool> finite{true};
  at::parallel_for(0, PP, 1, [&](int64_t q0, int64_t q1) {
    thread_local std::vector<at::BFloat16> split, rows;
    split.resize(size_t(keep ? q1 - q0 : 1) * parts * pair);
    rows.resize(size_t(2 * SPLIT_SWEEP_ROWS * K));
    at::BFloat16* xh = rows.data();
    at::BFloat16* xl = xh + SPLIT_SWEEP_ROWS * K;
    alignas(64) float c[AMX_MR * 32];
    kiln_amx_tiles_begin();
    for (int64_t s0 = 0; s0 < M && finite.load(std::memory_order_relaxed); s0 += SPLIT_SWEEP_ROWS) {
      const int64_t s1 = std::min(M, s0 + SPLIT_SWEEP_ROWS), padded = (s1 - s0 + AMX_MR - 1) / AMX_MR * AMX_MR;
      if (!k512::split_bf16(xp + s0 * K, (s1 - s0) * K, xh, xl)) finite.store(false);
      std::fill(xh + (s1 - s0) * K, xh + padded * K, at::BFloat16(0.f));
      std::fill(xl + (s1 - s0) * K, xl + padded * K, at::BFloat16(0.f));
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = 2 * q, np = p + 1 < P ? 2 : 1, cols = np * KILN_PANEL;
        at::BFloat16* bh = split.data() + (keep ? q - q0 : 0) * parts * pair;
        at::BFloat16* bl = bh + pair;
        if (!keep || s0 == 0) {   // the pair's first sweep: convert it (kept for the later sweeps)
          if (INT8) k512::int8_to_bf16(qp + p * K * KILN_PANEL, cols * K, bh);
          else k512::split_panels(wp + p * K * KILN_PANEL, np, K, bh, bl);
        }
        for (int64_t m0 = s0; m0 < s1; m0 += AMX_MR) {
          const int64_t r = (m0 - s0) * K;
          if (INT8 && np == 2) amx_block_xsplit<true>(xh + r, xl + r, K, bh, K, c);
          else if (INT8) amx_block_xsplit<false>(xh + r, xl + r, K, bh, K, c);
          else if (np == 2) amx_block_split<true>(xh + r, xl + r, K, bh, bl, K, c);
          else amx_block_split<false>(xh + r, xl + r, K, bh, bl, K, c);
          k512::store_f32_rows(c, 32, std::min(AMX_MR, M - m0), cols, INT8 ? scale + p * KILN_PANEL : nullptr,
                               bias ? bias + p * KILN_PANEL : nullptr, yp + m0 * N + p * KILN_PANEL, N);
        }
      }
    }
    kiln_amx_tiles_end();
    if (split.size() * sizeof(at::BFloat16) > SPLIT_KEEP_BYTES) std::vector<at::BFloat16>().swap(split);
  });
  return finite.load() ? y : at::Tensor();
}

using OptT = std::optional<at::Tensor>;

// A given bias as fp32 [N] (contiguous) in out, or undefined when none is given; false when it is not [N].
bool fp32_bias(const OptT& bias, int64_t N, at::Tensor& out) {
  if (!bias.has_value() || !bias->defined()) return true;
  if (bias->dim() != 1 || bias->size(0) != N) return false;
  // an fp32 bias as it is (no dispatched no-op conversion on the decode path)
  out = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
  return true;
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? static_cast<const float*>(t.const_data_ptr()) : nullptr;
}

// The decode paths (run, int4_panel) call no dispatched op for their tensors: a batch-1 decode step calls ~65
// linears, each right after a weight stream that evicted the dispatcher's code and tables, where a dispatched
// reshape, at::empty and view cost ~15-25 us a linear (perf, docs/benchmarks.md, session 29).

// x as the kernels read it: contiguous rows of fp32 or bf16 (x itself when it is; fp16 converted)
at::Tensor kernel_rows(const at::Tensor& x) {
  at::Tensor c = x.contiguous();  // no dispatcher call when x is contiguous
  return c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ? c : c.to(at::kFloat);
}

// a linear's output shape: x's leading dims + [N]
c10::SmallVector<int64_t, 5> out_shape(const at::Tensor& x, int64_t N) {
  c10::SmallVector<int64_t, 5> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}

// a linear's output of dtype, allocated without the dispatcher (its [M, N] rows contiguous)
at::Tensor linear_out(const at::Tensor& x, int64_t N, at::ScalarType dtype) {
  return at::detail::empty_cpu(out_shape(x, N), dtype);
}

// y [M, N] shaped as x's leading dims + [N]
at::Tensor with_out_features(const at::Tensor& y, const at::Tensor& x, int64_t N) { return y.view(out_shape(x, N)); }

// The AMX route of a panel weight with bf16 x (bf16 panels, or int8 panels with their per-output scales) from
// bf16_gemm_m rows: kiln's tile kernel where K is a multiple of 32 and the OS grants tile state, else (bf16 only)
// torch's brgemm per panel. Undefined when it does not apply (the caller runs the panel kernels) or the bias is
// not [N] (the caller's fallback says why).
template <bool INT8>
at::Tensor amx_route(const at::Tensor& x, const at::Tensor& w, const float* scale, const OptT& bias, int64_t N,
                     int64_t K) {
  const int64_t gemm_m = INT8 ? kiln_ops_int8_amx_m() : bf16_gemm_m();
  if (x.scalar_type() != at::kBFloat16 || gemm_m <= 0 || x.numel() / K < gemm_m) return at::Tensor();
  const bool tiles = K % AMX_KB == 0 && amx_tiles_permitted();
  at::Tensor b;
  if ((INT8 && !tiles) || !fp32_bias(bias, N, b)) return at::Tensor();
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const at::Tensor y = tiles ? panel_gemm_amx<INT8>(x2, w, scale, data_or_null(b), N, K)
                             : bf16_panel_gemm(x2, w, data_or_null(b), N, K);
  return with_out_features(y, x, N);
}


// The split-bf16 AMX route of fp32 panels with fp32 x from fp32_gemm_m rows, where K is a multiple of 32; undefined
// when it does not apply (the caller runs the fp32 panel kernels).
at::Tensor fp32_split_route(const at::Tensor& x, const at::Tensor& w, const OptT& bias, int64_t N, int64_t K) {
  const int64_t gemm_m = fp32_gemm_m();
  if (x.scalar_type() != at::kFloat || gemm_m <= 0 || x.numel() / K < gemm_m || K % AMX_KB != 0) return at::Tensor();
  at::Tensor b;
  if (!fp32_bias(bias, N, b)) return at::Tensor();
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const at::Tensor y = panel_gemm_amx_split<false>(x2, w, nullptr, data_or_null(b), N, K);
  return y.defined() ? with_out_features(y, x, N) : y;
}

// int8 panels with fp32 x from int8_split_m rows on AMX tiles, x split into bf16 halves (the weights exact in bf16):
// undefined when it does not apply (the caller runs the int8 kernels)
at::Tensor int8_split_route(const at::Tensor& x, const at::Tensor& w, const float* scale, const OptT& bias, int64_t N,
                            int64_t K) {
  const int64_t gemm_m = int8_split_m();
  if (x.scalar_type() != at::kFloat || gemm_m <= 0 || x.numel() / K < gemm_m || K % AMX_KB != 0 ||
      !amx_tiles_permitted())
    return at::Tensor();
  at::Tensor b;
  if (!fp32_bias(bias, N, b)) return at::Tensor();
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const at::Tensor y = panel_gemm_amx_split<true>(x2, w, scale, data_or_null(b), N, K);
  return y.defined() ? with_out_features(y, x, N) : y;
}

at::Tensor wol_py(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& s, const OptT& bias,
                  int64_t bits, int64_t gs, const OptT& zeros) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kiln::_weight_only_linear_py", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const OptT&, int64_t, int64_t, const OptT&)>();
  return op.call(x, qw, s, bias, bits, gs, zeros);
}

// kiln::_bf16_linear_py or kiln::_fp32_linear_py
template <int WTYPE>
at::Tensor float_linear_py(const at::Tensor& x, const at::Tensor& w, const OptT& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(WTYPE == KILN_W_BF16 ? "kiln::_bf16_linear_py" : "kiln::_fp32_linear_py", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&)>();
  return op.call(x, w, bias);
}

// a weight packed in 8-row tiles: [N/8, K/16, 8, 16]
bool packed_rows(const at::Tensor& w) {
  return w.dim() == 4 && w.size(2) == KILN_ROW_TILE && w.size(3) == KILN_K_STEP;
}

// a weight in the panel layout: fp32 [N/16, K, 16], bf16 / int8 [N/16, K/2, 16, 2]
bool panel_layout(const at::Tensor& w) {
  if (w.scalar_type() == at::kFloat) return w.dim() == 3 && w.size(2) == KILN_PANEL;
  return w.dim() == 4 && w.size(2) == KILN_PANEL && w.size(3) == KILN_PAIR;
}

// (N, K) of a plain [N, K], 8-row-tile or panel weight
std::pair<int64_t, int64_t> weight_nk(const at::Tensor& w) {
  if (panel_layout(w)) return {w.size(0) * KILN_PANEL, w.dim() == 3 ? w.size(1) : w.size(1) * KILN_PAIR};
  if (packed_rows(w)) return {w.size(0) * KILN_ROW_TILE, w.size(1) * KILN_K_STEP};
  return {w.size(0), w.dim() == 2 ? w.size(1) : 0};
}

bool act_ok(const at::Tensor& x, int64_t K) {
  const auto t = x.scalar_type();
  return x.dim() >= 1 && x.size(-1) == K && x.numel() > 0 &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}

// Runs the kernel; returns an undefined tensor if the kernel declined (caller falls back).
at::Tensor run(int wtype, const at::Tensor& x, const at::Tensor& w, const float* scales,
               const OptT& bias, int64_t gs, int64_t N, int64_t K) {
  // bf16 activations go to the kernel as they are (it widens x and rounds y itself); fp16 is
  // converted here
  const bool bf16_io = x.scalar_type() == at::kBFloat16;
  const int64_t M = x.numel() / K;
  const bool panel = kiln_is_panel(wtype);  // any M in one call
  if (!panel && M > g_max_m[kiln_weight_kind(wtype)].load(std::memory_order_relaxed)) return at::Tensor();
  const at::Tensor x2 = kernel_rows(x);
  at::Tensor b;
  if (!fp32_bias(bias, N, b)) return at::Tensor();
  const float* bp = data_or_null(b);
  at::Tensor y = linear_out(x, N, x2.scalar_type());
  const char* xp = static_cast<const char*>(x2.const_data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t es = x2.element_size();
  const int nt = at::get_num_threads();
  const int64_t step = panel ? M : KILN_MAX_M;
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const int64_t mc = std::min(step, M - m0);
    if (kiln_linear(wtype, w.const_data_ptr(), scales, gs, xp + m0 * K * es, mc, N, K, bp, yp + m0 * N * es, nt,
                    bf16_io) != 0)
      return at::Tensor();
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// int4 panels (qweight uint8 [N/16, K/8, 64], scales fp16 [N/16, G, 16], zeros uint8 like scales or none): the
// kernel's result, or an undefined tensor when it declines (x with NaN/inf, shapes it does not take).
at::Tensor int4_panel(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales, const OptT& bias,
                      int64_t gs, const OptT& zeros) {
  const int64_t N = qw.size(0) * KILN_PANEL, K = qw.size(1) * KILN_INT4_BLOCK;
  if (gs <= 0 || K % gs != 0 || !act_ok(x, K) || scales.scalar_type() != at::kHalf || scales.dim() != 3 ||
      scales.size(0) != qw.size(0) || scales.size(1) != K / gs || scales.size(2) != KILN_PANEL)
    return at::Tensor();
  const bool hasz = zeros.has_value() && zeros->defined();
  if (hasz && (zeros->scalar_type() != at::kByte || zeros->sizes() != scales.sizes())) return at::Tensor();
  const bool bf16_io = x.scalar_type() == at::kBFloat16;
  const at::Tensor x2 = kernel_rows(x);
  const int64_t M = x.numel() / K;
  at::Tensor b;
  if (!fp32_bias(bias, N, b)) return at::Tensor();
  const float* bp = data_or_null(b);
  const at::Tensor w = qw.contiguous(), s = scales.contiguous();
  at::Tensor z;
  if (hasz) z = zeros->contiguous();
  const int64_t gemm_m = g_int4_gemm_m.load(std::memory_order_relaxed);
  if (gemm_m > 0 && M >= gemm_m) {
    at::Tensor wb = at::empty({N, K}, x2.options().dtype(at::kBFloat16));
    if (kiln_dequant_int4_panel_bf16(w.const_data_ptr(), static_cast<const uint16_t*>(s.const_data_ptr()),
                                     hasz ? static_cast<const uint8_t*>(z.const_data_ptr()) : nullptr, gs, N, K,
                                     static_cast<uint16_t*>(wb.data_ptr()), at::get_num_threads()) != 0)
      return at::Tensor();
    at::Tensor y = at::mm(x2.reshape({M, K}).to(at::kBFloat16), wb.t()).to(at::kFloat);
    if (bp) y.add_(b);
    return with_out_features(y.to(x.scalar_type()), x, N);
  }
  at::Tensor y = linear_out(x, N, x2.scalar_type());
  if (kiln_linear_int4_panel(w.const_data_ptr(), static_cast<const uint16_t*>(s.const_data_ptr()),
                             hasz ? static_cast<const uint8_t*>(z.const_data_ptr()) : nullptr, gs,
                             x2.const_data_ptr(), M, N, K, bp, y.data_ptr(), at::get_num_threads(),
                             bf16_io) != 0)
    return at::Tensor();
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

at::Tensor weight_only_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                  const at::Tensor& scales, const OptT& bias, int64_t bits,
                                  int64_t group_size, const OptT& zeros) {
  if (bits == 4 && qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == 64) {
    at::Tensor y;
    if (g_enabled.load(std::memory_order_relaxed)) y = int4_panel(x, qweight, scales, bias, group_size, zeros);
    return y.defined() ? y : wol_py(x, qweight, scales, bias, bits, group_size, zeros);
  }
  const bool panel = bits == 8 && qweight.scalar_type() == at::kChar && panel_layout(qweight);
  const bool packed = bits == 8 && !panel && packed_rows(qweight);
  if (!g_enabled.load(std::memory_order_relaxed) || !(qweight.dim() == 2 || packed || panel))
    return wol_py(x, qweight, scales, bias, bits, group_size, zeros);
  const int64_t N = weight_nk(qweight).first;
  int wtype = -1;
  int64_t K = 0;
  if (bits == 8 && qweight.scalar_type() == at::kChar && scales.dim() == 1 && scales.size(0) == N) {
    wtype = panel ? KILN_W_INT8_PANEL : packed ? KILN_W_INT8_PACKED : KILN_W_INT8;
    K = weight_nk(qweight).second;
  } else if (bits == 4 && qweight.scalar_type() == at::kByte && group_size > 0) {
    K = 2 * qweight.size(1);
    if (K % group_size == 0 && scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size)
      wtype = KILN_W_INT4;
  }
  if (wtype < 0 || N == 0 || !act_ok(x, K) || scales.scalar_type() != at::kFloat)
    return wol_py(x, qweight, scales, bias, bits, group_size, zeros);
  const at::Tensor w = qweight.contiguous();
  const at::Tensor s = scales.contiguous();
  const float* sp = static_cast<const float*>(s.const_data_ptr());
  if (wtype == KILN_W_INT8_PANEL) {  // on AMX: the int8 values are exact in bf16; x bf16 as it is, fp32 x split
    at::Tensor y = x.scalar_type() == at::kFloat ? int8_split_route(x, w, sp, bias, N, K)
                                                 : amx_route<true>(x, w, sp, bias, N, K);
    if (y.defined()) return y;
  }
  at::Tensor y = run(wtype, x, w, sp, bias, wtype == KILN_W_INT4 ? group_size : 0, N, K);
  return y.defined() ? y : wol_py(x, qweight, scales, bias, bits, group_size, zeros);
}

// kiln::bf16_linear (KILN_W_BF16, bf16 weights) and kiln::fp32_linear (KILN_W_FP32, fp32 weights);
// a 4-D weight [N/8, K/16, 8, 16] is the packed layout (KILN_W_BF16_PACKED / KILN_W_FP32_PACKED)
template <int WTYPE>
at::Tensor float_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const OptT& bias) {
  const auto wdtype = WTYPE == KILN_W_BF16 ? at::kBFloat16 : at::kFloat;
  const bool panel = weight.scalar_type() == wdtype && panel_layout(weight);
  const bool packed = !panel && packed_rows(weight);
  if (!g_enabled.load(std::memory_order_relaxed) || !(weight.dim() == 2 || packed || panel) ||
      weight.scalar_type() != wdtype || weight.size(0) == 0)
    return float_linear_py<WTYPE>(x, weight, bias);
  const auto [N, K] = weight_nk(weight);
  if (!act_ok(x, K)) return float_linear_py<WTYPE>(x, weight, bias);
  const at::Tensor w = weight.contiguous();
  if (panel) {
    at::Tensor y = WTYPE == KILN_W_BF16 ? amx_route<false>(x, w, nullptr, bias, N, K)
                                        : fp32_split_route(x, w, bias, N, K);
    if (y.defined()) return y;
  }
  const int wtype = panel ? (WTYPE == KILN_W_BF16 ? KILN_W_BF16_PANEL : KILN_W_FP32_PANEL)
                  : packed ? (WTYPE == KILN_W_BF16 ? KILN_W_BF16_PACKED : KILN_W_FP32_PACKED) : WTYPE;
  at::Tensor y = run(wtype, x, w, nullptr, bias, 0, N, K);
  return y.defined() ? y : float_linear_py<WTYPE>(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("weight_only_linear", &weight_only_linear_cpu);
  m.impl("bf16_linear", &float_linear_cpu<KILN_W_BF16>);
  m.impl("fp32_linear", &float_linear_cpu<KILN_W_FP32>);
}

// AOTInductor C shims of the linears: a cpu-compiled engine's graph calls these directly instead of through the
// proxy executor (why, and the declarations these definitions must match: kiln.plugins.aoti_shims). They call the
// ops' CPU kernels, so native_kernels_disabled() still routes them to the Python implementations.
namespace {
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::pointer_to_optional;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

template <int WTYPE>
AOTITorchError float_linear_shim(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                 AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(float_linear_cpu<WTYPE>(*tensor_handle_to_tensor_pointer(x),
                                                      *tensor_handle_to_tensor_pointer(weight),
                                                      pointer_to_optional<at::Tensor>(bias)));
  });
}
}  // namespace

extern "C" {
AOTITorchError aoti_torch_cpu_weight_only_linear(AtenTensorHandle x, AtenTensorHandle qweight,
                                                 AtenTensorHandle scales, AtenTensorHandle* bias, int64_t bits,
                                                 int64_t group_size, AtenTensorHandle* zeros,
                                                 AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(weight_only_linear_cpu(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(qweight),
        *tensor_handle_to_tensor_pointer(scales), pointer_to_optional<at::Tensor>(bias), bits, group_size,
        pointer_to_optional<at::Tensor>(zeros)));
  });
}

AOTITorchError aoti_torch_cpu_bf16_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                          AtenTensorHandle* ret0) {
  return float_linear_shim<KILN_W_BF16>(x, weight, bias, ret0);
}

AOTITorchError aoti_torch_cpu_fp32_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                          AtenTensorHandle* ret0) {
  return float_linear_shim<KILN_W_FP32>(x, weight, bias, ret0);
}
}  // extern "C"

extern "C" {

void kiln_ops_set_enabled(int enabled) { g_enabled.store(enabled ? 1 : 0); }

int kiln_ops_enabled() { return g_enabled.load(std::memory_order_relaxed); }

// wtype: any weight type; the limit is its kind's (packed and plain layouts share one).
int64_t kiln_ops_max_m(int wtype) {
  if (kiln_is_panel(wtype)) return UNLIMITED;  // the panel kernels take any M
  const int kind = kiln_weight_kind(wtype);
  return kind >= 0 && kind < KILN_NUM_KINDS ? g_max_m[kind].load() : 0;
}

int64_t kiln_ops_int4_gemm_m() { return g_int4_gemm_m.load(); }

void kiln_ops_set_int4_gemm_m(int64_t m) { g_int4_gemm_m.store(m < 0 ? 0 : m); }

int64_t kiln_ops_bf16_gemm_m() { return bf16_gemm_m(); }

int64_t kiln_ops_fp32_gemm_m() { return fp32_gemm_m(); }

int kiln_ops_set_fp32_gemm_m(int64_t m) {
  if (m > 0 && !amx_tiles_permitted()) return 0;
  g_fp32_gemm_m.store(m < 0 ? 0 : m);
  return 1;
}

// int8 panels with bf16 x take the tile kernel from bf16_gemm_m rows, but never below 24: each call converts every
// panel pair to bf16 first, which below ~20 rows costs more than the int8 kernels' whole product (same section of
// docs/benchmarks.md).
constexpr int64_t INT8_AMX_MIN_M = 24;
int64_t kiln_ops_int8_amx_m() {
  const int64_t m = bf16_gemm_m();
  return m > 0 ? std::max(m, INT8_AMX_MIN_M) : 0;
}

int64_t kiln_ops_int8_split_m() { return int8_split_m(); }

int kiln_amx_tiles_permitted() { return amx_tiles_permitted() ? 1 : 0; }

void kiln_amx_tiles_begin() {
  // torch's brgemm caches which tile config it loaded last on this thread: drop that first, so that its next call
  // configures the tiles again instead of running on ours (or on none, after kiln_amx_tiles_end)
  at::native::cpublas::brgemm_release(true);
  amx_load_config();
}

void kiln_amx_tiles_end() { amx_release(); }

int kiln_ops_set_bf16_gemm_m(int64_t m) {
  if (m > 0 && !bf16_gemm_available()) return 0;
  g_bf16_gemm_m.store(m < 0 ? 0 : m);
  return 1;
}

void kiln_ops_set_max_m(int wtype, int64_t max_m) {
  const int kind = kiln_weight_kind(wtype);
  if (kind >= 0 && kind < KILN_NUM_KINDS) g_max_m[kind].store(max_m);
}

}  // extern "C"
