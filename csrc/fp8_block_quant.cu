// fp8_block's quantizing kernels (megatron_dist_moe/kernels/quant_fp8_cuda.py):
//   quant_rows_cols   the rows + columns quantizer: the contract of
//                     megatron_dist_moe.kernels.quant_fp8.quantize_rows_cols (Triton), bit for
//                     bit; its torch twin is quant/fp8_block.py (quantize_rows, quantize_cols)
//   swiglu_bwd_quant  the backward's SwiGLU pass quantizing its outputs from registers (its
//                     section below); twin: kernels/rows_ref.swiglu_bwd_quant_ref
// Both hold 128 x 128 tiles in registers and quantize them with quantize_tile.
//
//   rows bundle  q [R, K] e4m3, s [R, K/128] fp32: one scale per row and 128 columns
//   cols bundle  q_t [K, Rp] e4m3, s_t [Rp/128, K] fp32: one scale per column and 128 rows of
//                each expert's segment padded to a multiple of 128 rows (zeros in the padding),
//                stored transposed (the tokens contiguous: the WGRAD's K-major operand)
//
// Why CUDA C++: the column bundle is a transpose. Triton keeps each thread's values along a
// row, so its transposed e4m3 store went through layout conversions and ran at ~1.2-1.6 TB/s
// (docs/decisions.md) while the row direction ran at ~3.3. Here one block holds its 128 x 128
// bf16 tile in registers (one read; 16-byte loads, a half-warp per 256-byte row piece), takes
// the amaxes on packed bf16 pairs (exact: a max of bf16 values; two per instruction), the row
// amaxes over half-warp shuffles and the column amaxes over one shuffle and a shared-memory
// pass over the 8 warps, then unpacks each value once and scales it by its row's and its
// column's scale: the row bundle is stored from registers (8-byte pieces, a half-warp per row),
// the column bundle passes through a 16 KB shared tile, so each of its stores is a 16-byte piece
// of a 128-byte run. The kernel is bound by instruction issue as much as by bytes, hence the
// packed amaxes and the one pass.
//
// Thread t holds column group c8 = t % 16 (8 columns) of rows (v / 4) * 64 + (t / 16) * 4 +
// v % 4, v = 0..7: four consecutive rows per half of the tile, so its e4m3 values of one column
// and four rows are one 32-bit word of the transposed tile.
//
// Rounding as the Triton kernel and TransformerEngine's Float8BlockScaling: amax ignores NaN
// (an all-NaN block has amax 0), scale = 448 / max(amax, eps) rounded to nearest (inf ->
// bf16's max, amax 0 or inf -> 1, optionally a power of two by truncation), e4m3 by
// cvt.rn.satfinite (clamps to +-448, keeps NaN), the stored scale 1 / scale rounded to nearest.
//
// R and the expert offsets are device values: the grid covers the host bound's padded row
// blocks x K / 128 column blocks, and blocks past the call's last padded segment return.
// Nothing is read on the host; a call is one launch and can be captured in a CUDA graph.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dm_fp8q {

constexpr int kThreads = 256;
constexpr float kBf16Max = 3.3895313892515355e38f;   // TE's value_for_inf for bf16 inputs

struct Args {
  const int64_t* x_addr;     // bf16 [R, K] rows (nullptr with row_ptrs)
  const int64_t* row_ptrs;   // int64 [R]: row i's address (0: a row of zeros), or nullptr
  const int32_t* offsets;    // [E + 1] cumulative row ends
  const int64_t* q_addr;     // rows bundle (nullptr: none)
  const int64_t* s_addr;
  const int64_t* qc_addr;    // cols bundle (nullptr: none)
  const int64_t* sc_addr;
  int K, E;
  int pow2;
  float eps;
};

struct Segment {   // the expert segment holding this block's 128 padded rows
  int64_t start, n, pstart, rp;
  int found;
};

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// (scale, 1 / scale) of a block amax: quant/fp8_block.compute_scales
__device__ __forceinline__ float block_scale(float amax, float eps, int pow2, float& inv) {
  if (eps > 0.f) amax = fmaxf(amax, eps);
  float scale = __fdiv_rn(448.f, amax);
  if (isinf(scale)) scale = kBf16Max;
  if (amax == 0.f || isinf(amax)) scale = 1.f;
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  inv = __fdiv_rn(1.f, scale);
  return scale;
}

// two values -> two e4m3 bytes (a in the low byte)
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// Block pb's padded segment, found by warp 0 (32 experts per step, a warp prefix sum over the
// padded lengths) and broadcast through shared memory.
__device__ __forceinline__ void find_segment(const int32_t* offsets, int E, int64_t p0,
                                             Segment& seg) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int64_t carry = 0;
    int found = 0;
    int64_t start = 0, n = 0, pstart = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int64_t s = 0, len = 0;
      if (e < E) {
        s = offsets[e];
        len = offsets[e + 1] - s;
      }
      const int64_t plen = (len + 127) / 128 * 128;
      int64_t incl = plen;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int64_t o = __shfl_up_sync(0xFFFFFFFFu, incl, d);
        if (lane >= d) incl += o;
      }
      const int64_t ps = carry + incl - plen;
      const bool here = e < E && ps <= p0 && p0 < ps + plen;
      const unsigned who = __ballot_sync(0xFFFFFFFFu, here);
      if (who) {
        const int src = __ffs(who) - 1;
        start = __shfl_sync(0xFFFFFFFFu, s, src);
        n = __shfl_sync(0xFFFFFFFFu, len, src);
        pstart = __shfl_sync(0xFFFFFFFFu, ps, src);
        found = 1;
        break;
      }
      carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) {
      seg.start = start;
      seg.n = n;
      seg.pstart = pstart;
      seg.found = found;
      seg.rp = (static_cast<int64_t>(offsets[E]) + 127 * E + 127) / 128 * 128;
    }
  }
  __syncthreads();
}

// |x| of two bf16 values, and their max (max.bf16x2 ignores a NaN operand, as the Triton
// kernel's max.f32 does: only an all-NaN block gives NaN, which the caller maps to 0)
__device__ __forceinline__ uint32_t habs2(uint32_t w) { return w & 0x7FFF7FFFu; }
__device__ __forceinline__ uint32_t hmax2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// a bf16 amax (exact: the max of bf16 values) as fp32, NaN (an all-NaN block) as 0
__device__ __forceinline__ float amax_f32(uint32_t w, bool hi) {
  const float m = hi ? bf16_hi(w) : bf16_lo(w);
  return m != m ? 0.f : m;
}

// Thread t's place in a block's 128 x 128 tile (the layout above): its 8 columns from col0 of
// column block cb, its rows v = 0..7 at the segment's local rows row(v)
struct TilePlace {
  int c8, rg;
  int64_t col0, base, local0;   // base: the segment-local row of the tile's first row
  __device__ __forceinline__ TilePlace(const Segment& seg, int64_t pb, int cb)
      : c8(static_cast<int>(threadIdx.x) & 15),
        rg(static_cast<int>(threadIdx.x) >> 4),
        col0(static_cast<int64_t>(cb) * 128 + c8 * 8),
        base(pb * 128 - seg.pstart),
        local0(base + rg * 4) {}
  __device__ __forceinline__ int64_t row(int v) const { return local0 + (v >> 2) * 64 + (v & 3); }
  // row v's place in the tile (0..127)
  __device__ __forceinline__ int tile_row(int v) const { return rg * 4 + (v >> 2) * 64 + (v & 3); }
};

// The shared memory of one block's column bundles (COLS): the transposed e4m3 tile, the
// per-warp column amaxes, the column scales
struct ColSmem {
  __align__(16) uint32_t tile_t[128 * 32];   // e4m3 [128 cols][128 rows]
  __align__(16) uint32_t col_amax[8 * 64];   // bf16x2 per warp
  __align__(16) float col_scale[128];
};

// One 128 x 128 bf16 tile held in registers (xv, the thread layout above; rows past the segment
// are zeros) -> its row bundle (q [., K], s [., K / 128]: the tile is column block cb of K)
// and / or its column bundle (qc [K, rp], sc [rp / 128, K]; pb: the tile's padded row block).
// A block may call it several times in a row: each of its shared-memory phases is fenced by
// the __syncthreads that precede the next call's writes.
template <bool ROWS, bool COLS>
__device__ __forceinline__ void quantize_tile(const uint4 (&xv)[8], const Segment& seg,
                                              int64_t pb, int K, int cb, uint8_t* q, float* s,
                                              uint8_t* qc, float* sc, float eps, int pow2,
                                              ColSmem* sm) {
  const int t = threadIdx.x;
  const TilePlace at(seg, pb, cb);
  const int c8 = at.c8, rg = at.rg;
  const int nkb = K / 128;
  const int64_t p0 = pb * 128;

  // amaxes in bf16x2 (two values per instruction): rm[p] holds rows 2p, 2p + 1 (reduced over
  // the half-warp), cm[i] columns 2i, 2i + 1 of the thread's 8 (over its rows)
  uint32_t rm[4], cm[4] = {0, 0, 0, 0};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    uint32_t half[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint32_t* w = &xv[2 * p + u].x;
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t aw = habs2(w[i]);
        if constexpr (ROWS) m = i ? hmax2(m, aw) : aw;
        if constexpr (COLS) cm[i] = hmax2(cm[i], aw);
      }
      half[u] = m;
    }
    if constexpr (ROWS) {
      uint32_t m = hmax2(prmt(half[0], half[1], 0x5410), prmt(half[0], half[1], 0x7632));
#pragma unroll
      for (int d = 8; d > 0; d >>= 1) m = hmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, d));
      rm[p] = m;
    }
  }

  // row v's scales by thread c8 = v of its half-warp (two divisions per thread: each is a long
  // sequence), its inverse stored there; every thread takes the scales of its rows by shuffles
  float row_sc = 0.f;
  if constexpr (ROWS) {
    const uint32_t w01 = c8 & 2 ? rm[1] : rm[0], w23 = c8 & 2 ? rm[3] : rm[2];
    const uint32_t w = c8 & 4 ? w23 : w01;   // rows 2p, 2p + 1 with p = (c8 / 2) % 4
    float inv;
    row_sc = block_scale(amax_f32(w, c8 & 1), eps, pow2, inv);
    const int64_t local = at.local0 + (c8 >> 2 & 1) * 64 + (c8 & 3);   // row v = c8 & 7
    if (c8 < 8 && local < seg.n) s[(seg.start + local) * nkb + cb] = inv;
  }

  float cs[8];
  if constexpr (COLS) {
    const int warp = t >> 5, lane = t & 31;
#pragma unroll
    for (int i = 0; i < 4; ++i) cm[i] = hmax2(cm[i], __shfl_xor_sync(0xFFFFFFFFu, cm[i], 16));
    if (lane < 16)
      *reinterpret_cast<uint4*>(&sm->col_amax[warp * 64 + c8 * 4]) =
          make_uint4(cm[0], cm[1], cm[2], cm[3]);
    __syncthreads();
    if (t < 128) {
      uint32_t m = sm->col_amax[t >> 1];
#pragma unroll
      for (int w = 1; w < 8; ++w) m = hmax2(m, sm->col_amax[w * 64 + (t >> 1)]);
      float inv;
      sm->col_scale[t] = block_scale(amax_f32(m, t & 1), eps, pow2, inv);
      sc[pb * K + static_cast<int64_t>(cb) * 128 + t] = inv;
    }
    __syncthreads();
    const float4 s0 = *reinterpret_cast<const float4*>(&sm->col_scale[c8 * 8]);
    const float4 s1 = *reinterpret_cast<const float4*>(&sm->col_scale[c8 * 8 + 4]);
    cs[0] = s0.x, cs[1] = s0.y, cs[2] = s0.z, cs[3] = s0.w;
    cs[4] = s1.x, cs[5] = s1.y, cs[6] = s1.z, cs[7] = s1.w;
  }

  // one pass over the values: each unpacked once, scaled by its row's and its column's scale.
  // The column bundle's word for column j and four consecutive rows goes to the shared tile at
  // word (half * 16 + rg) of column j's 128 bytes, its bits 1..4 xor c8 (bank-conflict free:
  // the 32 lanes of a store differ in c8 and in rg's bit 0)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t cw[8];
    float prev[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = 4 * h + i;
      const uint32_t* w = &xv[v].x;
      const float rs = ROWS ? __shfl_sync(0xFFFFFFFFu, row_sc, (t & 16) + v) : 0.f;
      uint32_t rq[2];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float lo = bf16_lo(w[k]), hi = bf16_hi(w[k]);
        if constexpr (ROWS) {
          const uint32_t r16 = e4m3x2(lo * rs, hi * rs);
          rq[k >> 1] = k & 1 ? rq[k >> 1] | r16 << 16 : r16;
        }
        if constexpr (COLS) {
          const float clo = lo * cs[2 * k], chi = hi * cs[2 * k + 1];
          if (i & 1) {
            const uint32_t a16 = e4m3x2(prev[2 * k], clo), b16 = e4m3x2(prev[2 * k + 1], chi);
            cw[2 * k] = i == 1 ? a16 : cw[2 * k] | a16 << 16;
            cw[2 * k + 1] = i == 1 ? b16 : cw[2 * k + 1] | b16 << 16;
          } else {
            prev[2 * k] = clo;
            prev[2 * k + 1] = chi;
          }
        }
      }
      if constexpr (ROWS) {
        const int64_t local = at.row(v);
        if (local < seg.n)
          *reinterpret_cast<uint2*>(q + (seg.start + local) * K + at.col0) =
              make_uint2(rq[0], rq[1]);
      }
    }
    if constexpr (COLS) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm->tile_t[(c8 * 8 + j) * 32 + ((h * 16 + rg) ^ (c8 << 1))] = cw[j];
    }
  }

  if constexpr (COLS) {
    __syncthreads();
    // 16-byte pieces: piece k of column c holds words 4k .. 4k + 3, found at 4 (k ^ (cw >> 1))
    // with its two halves swapped where cw (the writers' c8) is odd
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = i * kThreads + t;
      const int c = piece >> 3, k = piece & 7;
      const int cw = c >> 3;
      uint4 v = *reinterpret_cast<const uint4*>(&sm->tile_t[c * 32 + 4 * (k ^ (cw >> 1))]);
      if (cw & 1) v = make_uint4(v.z, v.w, v.x, v.y);
      *reinterpret_cast<uint4*>(qc + (static_cast<int64_t>(cb) * 128 + c) * seg.rp + p0 + 16 * k) =
          v;
    }
  }
}

// 3 blocks per SM (80 registers): 4 (64 registers) measured 1-8 % slower (docs/decisions.md)
template <bool ROWS, bool COLS, bool GATHER>
__global__ void __launch_bounds__(kThreads, 3) quant_rows_cols(Args a) {
  __shared__ Segment seg;
  __shared__ ColSmem sm;   // (unused without COLS)

  const int nkb = a.K / 128;
  const int64_t pb = blockIdx.x / nkb;
  const int cb = blockIdx.x % nkb;
  find_segment(a.offsets, a.E, pb * 128, seg);
  if (!seg.found) return;   // past the last padded segment

  const TilePlace at(seg, pb, cb);
  uint4 xv[8];
  {
    const __nv_bfloat16* x =
        GATHER ? nullptr : reinterpret_cast<const __nv_bfloat16*>(*a.x_addr);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const int64_t local = at.row(v);
      const bool ok = local < seg.n;
      const __nv_bfloat16* src;
      if constexpr (GATHER) {
        src = reinterpret_cast<const __nv_bfloat16*>(ok ? a.row_ptrs[seg.start + local] : 0);
      } else {
        src = ok ? x + (seg.start + local) * a.K : nullptr;
      }
      xv[v] = src != nullptr ? *reinterpret_cast<const uint4*>(src + at.col0)
                             : make_uint4(0, 0, 0, 0);
    }
  }
  quantize_tile<ROWS, COLS>(
      xv, seg, pb, a.K, cb, ROWS ? reinterpret_cast<uint8_t*>(*a.q_addr) : nullptr,
      ROWS ? reinterpret_cast<float*>(*a.s_addr) : nullptr,
      COLS ? reinterpret_cast<uint8_t*>(*a.qc_addr) : nullptr,
      COLS ? reinterpret_cast<float*>(*a.sc_addr) : nullptr, a.eps, a.pow2, &sm);
}

template <bool ROWS, bool COLS, bool GATHER>
int launch(const Args& a, int blocks, cudaStream_t stream) {
  quant_rows_cols<ROWS, COLS, GATHER><<<blocks, kThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 100 + static_cast<int>(err);
}

// ---- the SwiGLU backward with its quantizations (fp8_block's W2 DGRAD, after the GEMM that
// stored u = g3 W2) ----
//
// One block per (padded 128-row block, 128-column block fb of F): u's tile (bf16) and the saved
// h1 row bundle's gate and up tiles (e4m3, one scale per row and 128 columns) are loaded once,
// in the quantizer's thread layout; each value's grad_h1 gate and up parts and h2 are computed
// in fp32 and rounded to bf16 (the values the composed path stores), and the three bf16 tiles
// are quantized from registers: grad_h1's row and column bundles (gate: column block fb of 2F,
// up: F / 128 + fb) and h2's column bundle. Neither grad_h1 nor h2 goes to memory in bf16:
// the composed path (swiglu_bwd_rows, then the quantizer twice) writes and reads them back,
// ~2.3x these bytes. The formulas are rows.swiglu_grad's (the fused epilogue's): with scores,
// dh = round(s u), h2 = round(s act(h1)) and the score-gradient part of each part_cols-wide
// column block is <u, round(act(h1))>, written to score_ptrs[r] + delta + part * stride.

struct BwdArgs {
  const int64_t* u_addr;     // bf16 [R, F]: u = g3 W2
  const int64_t* h1q_addr;   // e4m3 [R, 2F]: the saved h1 row bundle
  const int64_t* h1s_addr;   // fp32 [R, 2F / 128]
  const int32_t* offsets;    // [E + 1]
  const int64_t* gq_addr;    // grad_h1 row bundle: e4m3 [R, 2F], fp32 [R, 2F / 128]
  const int64_t* gs_addr;
  const int64_t* gqc_addr;   // grad_h1 column bundle: e4m3 [2F, Rp], fp32 [Rp / 128, 2F]
  const int64_t* gsc_addr;
  const int64_t* hqc_addr;   // h2 column bundle: e4m3 [F, Rp], fp32 [Rp / 128, F]
  const int64_t* hsc_addr;
  const int64_t* score_ptrs;   // int64 [R]: row r's score address (0: none), or nullptr
  int64_t score_grad_delta, part_stride;   // bytes
  int F, E, part_cols;
  float alpha, limit;
  int pow2;
  float eps;
};

// the scored variant's table of its tile's rows: each row's score address (0: none, and every
// padding row) and score
struct ScoreSmem {
  int64_t addr[128];
  float score[128];
};

// 1 / (1 + e^-x) on the approximate exp and reciprocal (as Triton's sigmoid): the IEEE-rounded
// reciprocal is an instruction sequence per value, which measured 217 -> 197 us for the pass
// (docs/decisions.md); e^-x = inf gives 0
__device__ __forceinline__ float sigmoid(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + __expf(-x)));
  return r;
}
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}
// two e4m3 bytes (the low 16 bits of w) -> two exact floats
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFF),
                                                  __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// (d act / dg * dh, d act / du * dh, act(g, u)): rows.swiglu_grad
template <bool CLAMPED>
__device__ __forceinline__ void swiglu_grad(float g, float u, float dh, float alpha, float limit,
                                            float& dg, float& du, float& h2v) {
  if constexpr (CLAMPED) {
    const float gc = fminf(g, limit), uc = fminf(fmaxf(u, -limit), limit);
    const float sg = sigmoid(alpha * gc);
    const float glu = gc * sg;
    dg = g < limit ? dh * (uc + 1.f) * (sg + alpha * gc * sg * (1.f - sg)) : 0.f;
    du = (u > -limit && u < limit) ? dh * glu : 0.f;
    h2v = glu * (uc + 1.f);
  } else {
    const float sg = sigmoid(g);
    const float silu = g * sg;
    dg = dh * u * (sg + g * sg * (1.f - sg));
    du = dh * silu;
    h2v = silu * u;
  }
}

// 2 blocks per SM (128 registers, 24-76 B of spills in three variants): the three output tiles
// stay in registers until they are quantized; 1 block per SM (248-255 registers) measured 24 %
// slower (docs/decisions.md)
template <bool SCORED, bool CLAMPED>
__global__ void __launch_bounds__(kThreads, 2) swiglu_bwd_quant(BwdArgs a) {
  __shared__ Segment seg;
  __shared__ ColSmem sm;
  __shared__ ScoreSmem ss;   // (unused without scores)

  const int nfb = a.F / 128;
  const int64_t pb = blockIdx.x / nfb;
  const int fb = blockIdx.x % nfb;
  find_segment(a.offsets, a.E, pb * 128, seg);
  if (!seg.found) return;   // past the last padded segment

  const TilePlace at(seg, pb, fb);
  const int64_t col0 = at.col0;
  const int64_t F = a.F;

  // loads: u (8 bf16 per row), the gate and up e4m3 (8 bytes per row) and scales of 8 rows
  uint4 uv[8];
  uint2 gv[8], vv[8];
  float gs[8], vs[8];
  {
    const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(*a.u_addr);
    const uint8_t* hq = reinterpret_cast<const uint8_t*>(*a.h1q_addr);
    const float* hs = reinterpret_cast<const float*>(*a.h1s_addr);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const int64_t local = at.row(v);
      const int64_t r = seg.start + local;
      if (local < seg.n) {
        uv[v] = *reinterpret_cast<const uint4*>(u + r * F + col0);
        gv[v] = *reinterpret_cast<const uint2*>(hq + r * 2 * F + col0);
        vv[v] = *reinterpret_cast<const uint2*>(hq + r * 2 * F + F + col0);
        gs[v] = hs[r * 2 * nfb + fb];
        vs[v] = hs[r * 2 * nfb + nfb + fb];
      } else {   // padding rows: zeros in every output (u = 0 makes every gradient 0)
        uv[v] = make_uint4(0, 0, 0, 0);
        gv[v] = vv[v] = make_uint2(0, 0);
        gs[v] = vs[v] = 0.f;
      }
    }
  }
  // the tile's 128 score addresses and scores, one row per thread of the first half, loaded
  // while the tile's loads above are in flight (the score waits for its address: kept out of
  // the loop above, the pair would hold each thread's rows in turn) and read back from shared
  // memory by the 16 threads of each row
  if constexpr (SCORED) {
    if (threadIdx.x < 128) {
      const int64_t local = at.base + threadIdx.x;
      const int64_t sa = local < seg.n ? a.score_ptrs[seg.start + local] : 0;
      ss.addr[threadIdx.x] = sa;
      ss.score[threadIdx.x] = sa != 0 ? *reinterpret_cast<const float*>(sa) : 0.f;
    }
    __syncthreads();
  }

  // the three bf16 tiles; with scores, each row's <u, round(act(h1))> over each part_cols-wide
  // column block: the thread's 8 columns, summed over the block's part_cols / 8 lanes of the
  // half-warp, the first of which writes it
  uint4 dgv[8], duv[8], h2v4[8];
  const int lanes = SCORED ? a.part_cols / 8 : 1;
  const int64_t part_off =
      SCORED ? a.score_grad_delta +
                   (static_cast<int64_t>(fb) * (128 / a.part_cols) + at.c8 / lanes) * a.part_stride
             : 0;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const uint32_t* uw = &uv[v].x;
    uint32_t* dgw = &dgv[v].x;
    uint32_t* duw = &duv[v].x;
    uint32_t* h2w = &h2v4[v].x;
    float part = 0.f;
    const float sv = SCORED ? ss.score[at.tile_row(v)] : 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t gw = (k < 2 ? gv[v].x : gv[v].y) >> (16 * (k & 1));
      const uint32_t vw = (k < 2 ? vv[v].x : vv[v].y) >> (16 * (k & 1));
      const float2 g2 = e4m3x2_to_float2(gw), v2 = e4m3x2_to_float2(vw);
      const float uf[2] = {bf16_lo(uw[k]), bf16_hi(uw[k])};
      const float gf[2] = {g2.x * gs[v], g2.y * gs[v]};
      const float vf[2] = {v2.x * vs[v], v2.y * vs[v]};
      float dg[2], du[2], h2[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float dh = SCORED ? round_bf16(sv * uf[j]) : uf[j];
        float h2f;
        swiglu_grad<CLAMPED>(gf[j], vf[j], dh, a.alpha, a.limit, dg[j], du[j], h2f);
        if constexpr (SCORED) {
          part += uf[j] * round_bf16(h2f);
          h2[j] = sv * h2f;
        } else {
          h2[j] = h2f;
        }
      }
      dgw[k] = pack_bf16x2(dg[0], dg[1]);
      duw[k] = pack_bf16x2(du[0], du[1]);
      h2w[k] = pack_bf16x2(h2[0], h2[1]);
    }
    if constexpr (SCORED) {
      for (int d = 1; d < lanes; d <<= 1) part += __shfl_xor_sync(0xFFFFFFFFu, part, d);
      if (at.c8 % lanes == 0) {   // (padding rows have address 0)
        const int64_t sa = ss.addr[at.tile_row(v)];
        if (sa != 0) *reinterpret_cast<float*>(sa + part_off) = part;
      }
    }
  }

  uint8_t* gq = reinterpret_cast<uint8_t*>(*a.gq_addr);
  float* gsr = reinterpret_cast<float*>(*a.gs_addr);
  uint8_t* gqc = reinterpret_cast<uint8_t*>(*a.gqc_addr);
  float* gsc = reinterpret_cast<float*>(*a.gsc_addr);
  const int K2 = 2 * a.F;
  quantize_tile<true, true>(dgv, seg, pb, K2, fb, gq, gsr, gqc, gsc, a.eps, a.pow2, &sm);
  quantize_tile<true, true>(duv, seg, pb, K2, nfb + fb, gq, gsr, gqc, gsc, a.eps, a.pow2, &sm);
  quantize_tile<false, true>(h2v4, seg, pb, a.F, fb, nullptr, nullptr,
                             reinterpret_cast<uint8_t*>(*a.hqc_addr),
                             reinterpret_cast<float*>(*a.hsc_addr), a.eps, a.pow2, &sm);
}

template <bool SCORED, bool CLAMPED>
int launch_bwd(const BwdArgs& a, int blocks, cudaStream_t stream) {
  swiglu_bwd_quant<SCORED, CLAMPED><<<blocks, kThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 100 + static_cast<int>(err);
}

}  // namespace dm_fp8q

// Returns 0, 1 (bad arguments: K not a positive multiple of 128, E < 1, no output bundle, neither
// or both of x_addr and row_ptrs) or 100 + the cudaError_t of a failed launch. n_pb: the host bound on the padded
// row blocks (layout.padded_rows(max_rows, E) / 128).
extern "C" int dm_fp8_block_quant_run(int K, int E, int64_t n_pb, const int64_t* x_addr,
                                      const int64_t* row_ptrs, const int32_t* offsets,
                                      const int64_t* q_addr, const int64_t* s_addr,
                                      const int64_t* qc_addr, const int64_t* sc_addr, int pow2,
                                      float eps, void* stream) {
  using namespace dm_fp8q;
  if (K < 128 || K % 128 != 0 || E < 1 || n_pb < 1) return 1;
  if ((x_addr == nullptr) == (row_ptrs == nullptr)) return 1;
  if ((q_addr == nullptr) != (s_addr == nullptr) || (qc_addr == nullptr) != (sc_addr == nullptr))
    return 1;
  const bool rows = q_addr != nullptr, cols = qc_addr != nullptr, gather = row_ptrs != nullptr;
  if (!rows && !cols) return 1;
  const int64_t blocks = n_pb * (K / 128);
  if (blocks > 0x7FFFFFFF) return 1;
  Args a{x_addr, row_ptrs, offsets, q_addr, s_addr, qc_addr, sc_addr, K, E, pow2, eps};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int b = static_cast<int>(blocks);
  if (rows && cols) return gather ? launch<true, true, true>(a, b, s) : launch<true, true, false>(a, b, s);
  if (rows) return gather ? launch<true, false, true>(a, b, s) : launch<true, false, false>(a, b, s);
  return gather ? launch<false, true, true>(a, b, s) : launch<false, true, false>(a, b, s);
}

// Returns 0, 1 (bad arguments: F not a positive multiple of 128, E < 1, a null operand, part_cols
// not one of 16, 32, 64, 128 with scores) or 100 + the cudaError_t of a failed launch. n_pb: as
// above.
extern "C" int dm_fp8_block_swiglu_bwd_quant_run(
    int F, int E, int64_t n_pb, const int64_t* u_addr, const int64_t* h1q_addr,
    const int64_t* h1s_addr, const int32_t* offsets, const int64_t* gq_addr,
    const int64_t* gs_addr, const int64_t* gqc_addr, const int64_t* gsc_addr,
    const int64_t* hqc_addr, const int64_t* hsc_addr, const int64_t* score_ptrs,
    int64_t score_grad_delta, int64_t part_stride, int part_cols, int clamped, float alpha,
    float limit, int pow2, float eps, void* stream) {
  using namespace dm_fp8q;
  if (F < 128 || F % 128 != 0 || E < 1 || n_pb < 1) return 1;
  for (const void* p : {static_cast<const void*>(u_addr), static_cast<const void*>(h1q_addr),
                        static_cast<const void*>(h1s_addr), static_cast<const void*>(offsets),
                        static_cast<const void*>(gq_addr), static_cast<const void*>(gs_addr),
                        static_cast<const void*>(gqc_addr), static_cast<const void*>(gsc_addr),
                        static_cast<const void*>(hqc_addr), static_cast<const void*>(hsc_addr)})
    if (p == nullptr) return 1;
  const bool scored = score_ptrs != nullptr;
  if (scored && (part_cols < 16 || part_cols > 128 || 128 % part_cols != 0)) return 1;
  const int64_t blocks = n_pb * (F / 128);
  if (blocks > 0x7FFFFFFF) return 1;
  BwdArgs a{u_addr,     h1q_addr,   h1s_addr,   offsets,          gq_addr,
            gs_addr,    gqc_addr,   gsc_addr,   hqc_addr,         hsc_addr,
            score_ptrs, score_grad_delta, part_stride, F, E, scored ? part_cols : 128,
            alpha,      limit,      pow2,       eps};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int b = static_cast<int>(blocks);
  if (scored) return clamped ? launch_bwd<true, true>(a, b, s) : launch_bwd<true, false>(a, b, s);
  return clamped ? launch_bwd<false, true>(a, b, s) : launch_bwd<false, false>(a, b, s);
}
