// A 16 x 16 transpose of dwords in AVX-512 registers, shared by the decode (plugin_ops.cpp) and prefill
// (attention_kernels.cpp) attention kernels. Included inside their anonymous namespaces, after <immintrin.h>; in
// k512:: with its own target, as all AVX-512 code is.
#pragma once

namespace k512 {

// r[i] (row i: 16 dwords) -> r[c]: column c of the 16 rows (dword i = row i's dword c)
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4g + c]: lane L = column 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

}  // namespace k512
