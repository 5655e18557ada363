// What the sources of the native library (kiln_kernels) share: the constants Python also needs, the
// weight types of the linear kernels and the library's C ABI.
//
// kiln/plugins/native.py reads the constants below from this text (`constexpr <type> KILN_<NAME> = <n>;`
// and the `KILN_W_<NAME> = <n>` enumerators), so they are written once; the build key that the library
// carries hashes this header with the sources, so a library never runs with other constants than the
// Python that loads it. The ctypes signatures of the C functions are declared in native.py (_declare).
// No torch header here: linear_kernels.cpp compiles without torch.

#pragma once

#include <cstdint>

// Packed weights (fp32, bf16, int8): [N/KILN_ROW_TILE][K/KILN_K_STEP][KILN_ROW_TILE][KILN_K_STEP], so the
// rows a GEMV tile reads together are one sequential stream.
constexpr int KILN_ROW_TILE = 8;
constexpr int KILN_K_STEP = 16;
// Rows of x one kiln_linear call takes at most; bigger M is cut into calls of this size (the panel
// layouts below take any M in one call).
constexpr int64_t KILN_MAX_M = 64;
// Panel layouts (what the builder stores): panels of KILN_PANEL output rows, one sequential stream each;
// fp32 [N/16][K][16], bf16 and int8 [N/16][K/2][16][2] (pairs of consecutive k). See panel_kernels.h.
constexpr int KILN_PANEL = 16;
constexpr int KILN_PAIR = 2;
// int4 panels: [N/16][K/8][64] bytes, blocks of KILN_INT4_BLOCK consecutive k of a panel's 16 rows in one 64-byte
// line (see panel_kernels.h); fp16 scales and uint8 zero points [N/16][K/group_size][16].
constexpr int KILN_INT4_BLOCK = 8;

// Weight types of kiln_linear / kiln_dequant_rows (Python names them by the lower-cased suffix).
enum KilnWeightType : int {
  KILN_W_BF16 = 0,         // uint16 bf16 bits [N, K]
  KILN_W_INT8 = 1,         // int8 [N, K], one fp32 scale per row
  KILN_W_INT4 = 2,         // uint8 [N, K/2] nibbles, fp32 scales [N, K/group_size]
  KILN_W_FP32 = 3,         // fp32 [N, K]
  KILN_W_BF16_PACKED = 4,  // the packed layouts of the above
  KILN_W_FP32_PACKED = 5,
  KILN_W_INT8_PACKED = 6,
  KILN_W_FP32_PANEL = 7,   // the panel layouts of fp32, bf16, int8
  KILN_W_BF16_PANEL = 8,
  KILN_W_INT8_PANEL = 9,
  KILN_W_INT4_PANEL = 10,  // kiln_linear_int4_panel (fp16 scales, optional zero points)
};

// The weight type without its layout (the kernels' M limits are per kind): one of the first four.
constexpr int kiln_weight_kind(int wtype) {
  return wtype == KILN_W_BF16_PACKED || wtype == KILN_W_BF16_PANEL ? KILN_W_BF16
       : wtype == KILN_W_FP32_PACKED || wtype == KILN_W_FP32_PANEL ? KILN_W_FP32
       : wtype == KILN_W_INT8_PACKED || wtype == KILN_W_INT8_PANEL ? KILN_W_INT8
       : wtype == KILN_W_INT4_PANEL ? KILN_W_INT4
       : wtype;
}
constexpr bool kiln_is_panel(int wtype) {
  return wtype == KILN_W_FP32_PANEL || wtype == KILN_W_BF16_PANEL || wtype == KILN_W_INT8_PANEL ||
         wtype == KILN_W_INT4_PANEL;
}
constexpr int KILN_NUM_KINDS = 4;

// The build key (kiln/plugins/native.py build_key) is passed as -DKILN_BUILD_KEY=<identifier>; Python
// reads it from the library file (after the "kiln-build-key:" mark) before loading it.
#define KILN_STR2(x) #x
#define KILN_STR(x) KILN_STR2(x)

extern "C" {

// linear_kernels.cpp (no torch). Return 0 on success, a positive code when the case is not
// supported (the caller falls back). x [M, K] and y [M, N]: fp32, or bf16 when bf16_io != 0.
int kiln_linear(int wtype, const void* w, const float* scales, int64_t group_size, const void* x, int64_t M,
                int64_t N, int64_t K, const float* bias, void* y, int nthreads, int bf16_io);
// int4 panels (KILN_W_INT4_PANEL): w [N/16][K/8][64] bytes, scales fp16 bits [N/16][G][16], zeros uint8
// [N/16][G][16] (0..15) or null (every zero point 8), G = K / group_size; w(n, k) = (u - zero) * scale.
int kiln_linear_int4_panel(const void* w, const uint16_t* scales, const uint8_t* zeros, int64_t group_size,
                           const void* x, int64_t M, int64_t N, int64_t K, const float* bias, void* y, int nthreads,
                           int bf16_io);
// How kiln_linear_int4_panel rounds x: 16 (int16 per row, the default) or 8 (int8 per weight group: error <=
// max|x_group| / 254, half the dot products; KILN_INT4_X_BITS=8 at load). set: 0, or 1 for another value.
int kiln_int4_x_bits();
int kiln_set_int4_x_bits(int bits);
// int4 panels (as kiln_linear_int4_panel's) -> bf16 bits [N][K] row-major, (u - zero) * scale rounded to nearest
// even: 0, or 2 when the shape does not fit the layout.
int kiln_dequant_int4_panel_bf16(const void* w, const uint16_t* scales, const uint8_t* zeros, int64_t group_size,
                                 int64_t N, int64_t K, uint16_t* out, int nthreads);
// The panel kernels' tunables by name (prefetch distances in bytes ahead, 0 = off; panels per decode stream; row_nta
// 0/1: the one-row decode streams prefetch non-temporally; the list: kiln/plugins/tuning.py TUNABLES):
// 0, or 1 for an unknown name (2: a value out of range).
int kiln_get_tuning(const char* name, int64_t* value);
// The kernel a panel-layout weight of type wtype runs at M rows of x, with its tuning, as text into buf.
int kiln_describe_kernel(int wtype, int64_t M, int64_t N, char* buf, int64_t len);
int kiln_set_tuning(const char* name, int64_t value);
// Dequantize rows [n0, n1) to fp32 out[(n - n0) * K + k].
int kiln_dequant_rows(int wtype, const void* w, const float* scales, int64_t group_size, int64_t N, int64_t K,
                      int64_t n0, int64_t n1, float* out, int nthreads);
// The vector width the panel kernels use: 512 (AVX-512 with BW and VNNI, when the CPU has them) or 256
// (AVX2 + FMA). kiln_set_panel_isa(0) picks the best the CPU has, 256 forces AVX2 (tests compare both);
// a width the CPU lacks is refused (returns the width in use).
int kiln_panel_isa();
// decode attention: with fewer rows than threads, rows of at least this many positions are split across the
// threads and read whole slots at a time (tunable attn_span_context; 0: one kv head per work item always)
int64_t kiln_attn_span_context();
int kiln_set_panel_isa(int bits);
// Sum of n floats read with nthreads threads: the streaming read the benchmarks compare the GEMVs with.
double kiln_stream_sum(const float* p, int64_t n, int nthreads);
// Median us of an empty parallel region of nthreads on the calling thread's team (kiln.plugins.openmp_teams).
double kiln_openmp_region_us(int nthreads);

// linear_ops.cpp: one switch for the whole library's C++ op kernels (off: they call the Python
// implementations), and the largest M each weight kind runs through the kernels.
void kiln_ops_set_enabled(int enabled);
int kiln_ops_enabled();
int64_t kiln_ops_max_m(int wtype);
void kiln_ops_set_max_m(int wtype, int64_t max_m);
// Rows of x from which an int4-panel weight is dequantized to bf16 for a bf16 GEMM (oneDNN: AMX where present)
// instead of the int4 kernels; 0: never (the default on CPUs without AMX-BF16).
int64_t kiln_ops_int4_gemm_m();
void kiln_ops_set_int4_gemm_m(int64_t m);
// Rows of x from which bf16 panels with bf16 x run as oneDNN bf16 GEMMs; 0: never. Setting m > 0 returns 0 (and
// changes nothing) where torch's brgemm cannot take bf16 (no AMX-BF16), else 1.
int64_t kiln_ops_bf16_gemm_m();
// Rows of fp32 x from which fp32 panels run on AMX tiles with both operands split into bf16 halves (0: never).
// Setting m > 0 returns 0 (and changes nothing) where the CPU has no AMX-BF16 or the OS refuses tile state, else 1.
int64_t kiln_ops_fp32_gemm_m();
int kiln_ops_set_fp32_gemm_m(int64_t m);
// rows of bf16 x from which int8 panels take the AMX tile kernel (0: never)
int64_t kiln_ops_int8_amx_m();
// rows of fp32 x from which int8 panels take the AMX tile kernel, x split into bf16 halves (0: never)
int64_t kiln_ops_int8_split_m();
int kiln_ops_set_bf16_gemm_m(int64_t m);
// AMX tile state for kernels outside torch (attention_kernels.cpp). permitted: 1 where the CPU has AMX-BF16 and the
// OS granted this process tile state. begin (on each thread, before its tile code): torch's brgemm drops the tile
// config it cached for the thread and kiln's (all 8 tiles 16 rows x 64 bytes) is loaded; end: the tiles released.
int kiln_amx_tiles_permitted();
void kiln_amx_tiles_begin();
void kiln_amx_tiles_end();

// attention_kernels.cpp (no torch): causal attention of n new tokens at the end of a ctx-token context, bf16 q
// [n][Hq][D], k and v [ctx][Hkv][D], out [n][Hq][D] (query i sees keys 0 .. ctx - n + i); needs AVX-512 BF16 and
// D % 64 == 0, D <= 256. With a block table (table != nullptr), k and v are one layer of a KV pool, [num_blocks]
// [block_size][Hkv][D], key j in block table[j / block_size] at slot j % block_size. 0 on success, 1 without the
// ISA, 2 for a shape it does not take (or a table entry outside the pool).
int kiln_causal_attention_available();
int kiln_causal_attention_bf16(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                               int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads, const int32_t* table,
                               int64_t block_size, int64_t num_blocks);
// The same in fp32 (q, k, v, out fp32; one FMA per d and per key, nothing rounded below fp32).
int kiln_causal_attention_f32(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t ctx,
                              int64_t hq, int64_t hkv, int64_t D, float scale, int nthreads, const int32_t* table,
                              int64_t block_size, int64_t num_blocks);
// Does the bf16 kernel run its products on AMX tiles (1), or vdpbf16ps (0)? set: on = 1 (where
// kiln_amx_tiles_permitted) or 0; returns the previous setting. Default: on where permitted.
int kiln_causal_attention_amx();
int kiln_causal_attention_set_amx(int on);
// block_cache.cpp: torch's CPU allocator keeping freed blocks of >= min_bytes (up to cap_bytes in all) for reuse
// (kiln.plugins.block_cache). install: 0, or 1 when an allocator of a higher priority holds the slot; stats:
// out[6] = cap, min bytes, cached bytes, cached blocks, hits, misses (1: never installed).
int kiln_block_cache_install(int64_t cap_bytes, int64_t min_bytes);
int kiln_block_cache_stats(int64_t* out);

}  // extern "C"
