// Shared by the NVFP4 GEMMs of csrc/ (nvfp4_decode_mm.cu, nvfp4_wgmma_mm.cu): their argument
// block (the contract of megatron_dist_moe.kernels.grouped_gemm.nvfp4.nvfp4_grouped_mm with
// a16) and the weight decode, E2M1 codes of a 16-byte load straight into fp16 MMA fragments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dm_nvfp4 {

constexpr int kChunk = 128;   // k values of one step of a thread quad (16 bytes per row each)

struct Args {
  const int64_t* a16_addr;    // fp16 [>= R, K], row stride K
  const int64_t* a_addr;      // NVFP4 byte rows: the fp32 S_dec at byte K/2 + K/16 of a row
  int64_t a_stride;           // bytes between NVFP4 rows
  const uint8_t* w_packed;    // [E, N, K/2]
  const uint8_t* w_scales;    // E4M3 [E, N/16, K/16]
  const float* w_senc;        // [E]
  const int32_t* offsets;     // [E + 1]
  const int64_t* out_addr;    // "store": bf16 [R, N] at *out_addr
  const int64_t* out_rows;    // "scatter": bf16 row r at out_rows[r] (0: skipped), or nullptr
  int E, N, K;
};

// weights are read once: keep them out of L1 (the token rows live there) and let L2 fetch the
// rest of each row's 256-byte run
__device__ __forceinline__ uint4 ld_weights(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t lop_or_and8(uint32_t a, uint32_t b) {
  // (a & 0x80808080) | b, b already masked to 0x1C1C1C1C
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(0x80808080u), "r"(b));
  return d;
}

// four E4M3 bytes -> two f16x2 (bytes 0, 1 -> lo; 2, 3 -> hi)
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// two E4M3 scales (low byte first) -> f16x2
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t s) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(s));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One word w (values 0..7 in nibbles 0..7) into four f16x2 MMA operands r[0..3], times the
// block scale: the E2M1 bits placed into E4M3 bytes (value x 2^-6: the sign to bit 7, the
// magnitude to bits 4..2, so E2M1's subnormal 0.5 lands on E4M3's 2^-7), then the hardware
// E4M3 -> f16x2 conversion. r = (v0, v2) (v1, v3) (v4, v6) (v5, v7); each k16 MMA takes
// (r[0], r[1]) and then (r[2], r[3]) as its (a0 / a1, a2 / a3) slots.
constexpr float kUnscale = 64.0f;   // 2^6: what the placement took off, given back in fp32

__device__ __forceinline__ void decode_word(uint32_t w, uint32_t sc, uint32_t (&r)[4]) {
  // low nibbles (values 0, 2, 4, 6) and high nibbles (1, 3, 5, 7) as E4M3 bytes
  const uint32_t lo = lop_or_and8((w << 4), (w << 2) & 0x1C1C1C1Cu);
  const uint32_t hi = lop_or_and8(w, (w >> 2) & 0x1C1C1C1Cu);
  uint32_t f[4];
  e4m3x4_to_f16x4(lo, f[0], f[2]);   // (v0, v2), (v4, v6)
  e4m3x4_to_f16x4(hi, f[1], f[3]);   // (v1, v3), (v5, v7)
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = hmul2(f[i], sc);
}

// the f16x2 block scales of a thread's 32 values (two E4M3 scales, low byte first): [0] for
// values 32q .. 32q + 15 (block 2q), [1] for the next 16 (block 2q + 1)
__device__ __forceinline__ void block_scales(uint16_t s, uint32_t (&scale)[2]) {
  const uint32_t s2 = e4m3x2_to_f16x2(s);
  scale[0] = prmt(s2, 0, 0x1010);
  scale[1] = prmt(s2, 0, 0x3232);
}

}  // namespace dm_nvfp4
