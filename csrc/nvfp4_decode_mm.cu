// NVFP4 grouped GEMM for the decode regime (inference, a few token rows per expert):
//   out[r, n] = S_dec(r) * S_dec(e) * sum_k dequant(a)[r, k] * dequant(W[e])[n, k]
// for the rows r of expert e, [offsets[e], offsets[e+1]): the contract of
// megatron_dist_moe.kernels.grouped_gemm.nvfp4.nvfp4_grouped_mm with a16 (the token rows'
// values decoded once, before their global scales); the same torch twin checks both.
//
// Why a CUDA kernel: with 8-32 rows per expert the GEMM is a weight stream (4.5 bits per
// weight) and the E2M1 decode is the work. Triton places the decoded values through layout
// conversions; here each thread decodes exactly the weights its MMA fragment needs, straight
// from its 16-byte loads, and nothing passes through shared memory.
//
// Operand roles are swapped (weights are the MMA's M side, tokens its N side): one
// mma.sync.m16n8k16 covers 16 weight rows x 8 tokens, so a handful of tokens wastes no weight
// decode. The contraction order inside a 128-wide k chunk is permuted: thread (g, q) of a warp
// (g = lane / 4, q = lane % 4) loads bytes [16q, 16q + 16) of weight rows g and g + 8, i.e.
// the 32 consecutive values k in [32q, 32q + 32), and feeds them to the MMA in whatever
// fragment slots are cheapest to fill; the token side reads the same k positions for the same
// slots, so the sum is the same dot product in another order (fp32 accumulation either way).
//
// Decode: a 32-bit word holds nibbles n_0..n_7 (value i in nibble i). Four integer
// instructions place its eight E2M1 codes into E4M3 bytes (value x 2^-6), two hardware
// conversions turn them into four f16x2 registers, and one f16x2 multiply each applies the
// E4M3 block scale. Exact: an E2M1 value x 2^-6 times an E4M3 scale is a multiple of 2^-16
// with at most six significant bits, below 43. The epilogue multiplies the fp32 sum by 2^6
// (exact) and the two global decode scales, in the Triton kernel's order.
//
// Launch: one block of WARPS warps per (expert, WARPS / SPLIT * ROWS weight rows); every warp
// streams its ROWS rows over 1 / SPLIT of K with the next P - 1 chunks' loads in flight (a
// register ring), and the SPLIT warps of a row group add their sums through shared memory in
// a fixed order, so a GEMM is one wave of small, equal pieces of work. Experts without rows return at once (no
// weight read). More rows than 8 * NT in an expert: the weights are read again per group of
// 8 * NT rows. Nothing is read on the host; a call is one launch and can be captured in a CUDA
// graph.

#include "nvfp4_decode.cuh"

namespace dm_nvfp4 {

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One chunk's operands of one thread: MT weight tiles (rows g and g + 8 of each: 16 bytes,
// 32 values, and their two block scales) and NT token columns (32 fp16 values each).
template <int MT, int NT>
struct Chunk {
  uint4 w[MT][2];
  uint16_t s[MT];
  uint4 t[NT][4];
};

template <int MT, int NT>
__device__ __forceinline__ void load_chunk(Chunk<MT, NT>& c, const uint8_t* const (&w_row)[MT][2],
                                           const uint8_t* const (&s_row)[MT],
                                           const __half* const (&t_row)[NT], int k0, int q) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) c.w[m][h] = ld_weights(w_row[m][h] + k0 / 2 + 16 * q);
    c.s[m] = __ldg(reinterpret_cast<const uint16_t*>(s_row[m] + k0 / 16 + 2 * q));
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const uint4* p = reinterpret_cast<const uint4*>(t_row[n] + k0 + 32 * q);
#pragma unroll
    for (int i = 0; i < 4; ++i) c.t[n][i] = __ldg(p + i);
  }
}

// the token pairs of the same k slots from eight consecutive fp16 values t0..t7
__device__ __forceinline__ void token_pairs(const uint4& u, uint32_t (&b)[4]) {
  b[0] = prmt(u.x, u.y, 0x5410);   // (t0, t2)
  b[1] = prmt(u.x, u.y, 0x7632);   // (t1, t3)
  b[2] = prmt(u.z, u.w, 0x5410);   // (t4, t6)
  b[3] = prmt(u.z, u.w, 0x7632);   // (t5, t7)
}

template <int MT, int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][NT][4], const Chunk<MT, NT>& c) {
  uint32_t scale[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    block_scales(c.s[m], scale[m]);
  }
#pragma unroll
  for (int v = 0; v < 4; ++v) {   // word v: values 32q + 8v .. 32q + 8v + 7
    // token fragments: the slot pairs (t_j, t_{j+4}) of the word, matching R_j
    uint32_t b[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) token_pairs(c.t[n][v], b[n]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const uint32_t sc = scale[m][v / 2];
      const uint32_t wg = (&c.w[m][0].x)[v], wh = (&c.w[m][1].x)[v];   // rows g, g + 8
      uint32_t ag[4], ah[4];
      decode_word(wg, sc, ag);
      decode_word(wh, sc, ah);
      // two k16 steps per word: a0 / a1 = ag / ah[0], a2 / a3 = ag / ah[1], then [2] and [3]
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        mma16816(acc[m][n], ag[0], ah[0], ag[1], ah[1], b[n][0], b[n][1]);
        mma16816(acc[m][n], ag[2], ah[2], ag[3], ah[3], b[n][2], b[n][3]);
      }
    }
  }
}

template <int ROWS, int NT, int WARPS, int P, int SPLIT>
__global__ void __launch_bounds__(WARPS * 32) nvfp4_decode_mm_kernel(Args args) {
  constexpr int MT = ROWS / 16;
  constexpr int GROUPS = WARPS / SPLIT;   // row groups of a block; SPLIT warps share one
  static_assert(WARPS % SPLIT == 0, "SPLIT must divide WARPS");
  const int N = args.N, K = args.K;
  const int blocks_per_expert = (N + GROUPS * ROWS - 1) / (GROUPS * ROWS);
  const int e = blockIdx.x / blocks_per_expert;
  const int r0 = args.offsets[e], r1 = args.offsets[e + 1];
  if (r0 >= r1) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int group = warp / SPLIT, slice = warp % SPLIT;
  const int row_base = (blockIdx.x % blocks_per_expert) * GROUPS * ROWS + group * ROWS;
  // the k slice of this warp: chunks [c0, c1) of K / kChunk
  const int chunks = K / kChunk;
  const int c0 = slice * chunks / SPLIT, c1 = (slice + 1) * chunks / SPLIT;

  const uint8_t* w_row[MT][2];
  const uint8_t* s_row[MT];
  bool m_ok[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    // N % 16 == 0: whole m-tiles only; a tile past N reads tile 0 and is never stored (its
    // warp still takes part in the block's reduction)
    m_ok[m] = row_base + 16 * m < N;
    const int64_t tile_row = m_ok[m] ? row_base + 16 * m : 0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w_row[m][h] = args.w_packed + ((int64_t)e * N + tile_row + g + 8 * h) * (K / 2);
    s_row[m] = args.w_scales + ((int64_t)e * (N / 16) + tile_row / 16) * (K / 16);
  }
  const __half* a16 = reinterpret_cast<const __half*>(*args.a16_addr);
  const uint8_t* a_rows = reinterpret_cast<const uint8_t*>(*args.a_addr);
  // S_dec = 1 / S_enc correctly rounded, read each launch (a graph replay sees weights
  // updated in place)
  const float w_dec = __frcp_rn(args.w_senc[e]);
  // the partial sums of slices 1 .. SPLIT - 1, added by slice 0 in slice order (deterministic)
  constexpr int kPart = MT * NT * 4;
  __shared__ float part[SPLIT > 1 ? (SPLIT - 1) * GROUPS * 32 * kPart : 1];

  for (int tg = r0; tg < r1; tg += 8 * NT) {
    const __half* t_row[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n)   // token column g of group n; past the expert: its last row
      t_row[n] = a16 + (int64_t)min(tg + 8 * n + g, r1 - 1) * K;
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;

    // a ring of P chunks in registers: P - 1 chunks' loads in flight while one is multiplied
    Chunk<MT, NT> ring[P];
#pragma unroll
    for (int p = 0; p < P - 1; ++p)
      if (c0 + p < c1) load_chunk(ring[p], w_row, s_row, t_row, (c0 + p) * kChunk, q);
    for (int cb = c0; cb < c1; cb += P) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int c = cb + p;
        if (c >= c1) break;
        if (c + P - 1 < c1)
          load_chunk(ring[(p + P - 1) % P], w_row, s_row, t_row, (c + P - 1) * kChunk, q);
        mma_chunk<MT, NT>(acc, ring[p]);
      }
    }

    if constexpr (SPLIT > 1) {
      float* mine = part + (((slice - 1) * GROUPS + group) * 32 + lane) * kPart;
      if (slice > 0) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) mine[(m * NT + n) * 4 + i] = acc[m][n][i];
      }
      __syncthreads();
      if (slice == 0) {
#pragma unroll
        for (int sl = 1; sl < SPLIT; ++sl) {
          const float* other = part + (((sl - 1) * GROUPS + group) * 32 + lane) * kPart;
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[m][n][i] += other[(m * NT + n) * 4 + i];
        }
      }
      __syncthreads();   // the next token group rewrites part
      if (slice > 0) continue;
    }

    // epilogue: acc[m][n][i] is weight row row_base + 16m + g + 8 (i / 2), token row
    // tg + 8n + 2q + (i % 2)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int r = tg + 8 * n + 2 * q + c;
        if (r >= r1) continue;
        const float s = *reinterpret_cast<const float*>(a_rows + (int64_t)r * args.a_stride
                                                        + K / 2 + K / 16);
        __nv_bfloat16* o;
        if (args.out_rows != nullptr) {
          const int64_t p = args.out_rows[r];
          if (p == 0) continue;
          o = reinterpret_cast<__nv_bfloat16*>(p);
        } else {
          o = reinterpret_cast<__nv_bfloat16*>(*args.out_addr) + (int64_t)r * N;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (!m_ok[m]) continue;
          const int col = row_base + 16 * m + g;
          // the Triton kernel's order: (sum * S_dec(row)) * S_dec(expert)
          o[col] = __float2bfloat16_rn(acc[m][n][c] * kUnscale * s * w_dec);
          o[col + 8] = __float2bfloat16_rn(acc[m][n][2 + c] * kUnscale * s * w_dec);
        }
      }
    }
  }
}

template <int ROWS, int NT, int WARPS, int P, int SPLIT>
int launch(const Args& args, cudaStream_t stream) {
  constexpr int kBlockRows = WARPS / SPLIT * ROWS;
  const int blocks_per_expert = (args.N + kBlockRows - 1) / kBlockRows;
  nvfp4_decode_mm_kernel<ROWS, NT, WARPS, P, SPLIT>
      <<<args.E * blocks_per_expert, WARPS * 32, 0, stream>>>(args);
  return cudaGetLastError() == cudaSuccess ? 0 : 5;
}

}  // namespace dm_nvfp4

#define DM_NVFP4_VARIANTS(X) \
  X(16, 1, 4, 2, 1) X(32, 1, 4, 2, 1) X(64, 1, 2, 2, 1) X(32, 2, 4, 2, 1) X(32, 4, 4, 2, 1) \
  X(64, 4, 2, 1, 1) X(32, 1, 4, 2, 2) X(32, 1, 8, 2, 2) X(32, 1, 4, 2, 4) X(16, 1, 4, 2, 2) \
  X(32, 2, 4, 2, 2) X(64, 4, 2, 1, 2) X(64, 4, 4, 1, 4) X(64, 2, 2, 2, 2) X(48, 4, 4, 1, 1)

// variant = (split - 1) * 100000 + weight rows per warp * 1000 + token groups of 8 * 100 +
// warps * 10 + ring depth
extern "C" int dm_nvfp4_decode_mm_run(int variant, int E, int N, int K, int64_t a_stride,
                                      const int64_t* a16_addr, const int64_t* a_addr,
                                      const void* w_packed, const void* w_scales,
                                      const float* w_senc, const int32_t* offsets,
                                      const int64_t* out_addr, const int64_t* out_rows,
                                      void* stream) {
  using namespace dm_nvfp4;
  if (E < 1 || N < 16 || N % 16 != 0 || K < kChunk || K % kChunk != 0 || a_stride % 4 != 0)
    return 1;
  if ((out_addr == nullptr) == (out_rows == nullptr)) return 1;
  Args args{a16_addr, a_addr, a_stride, static_cast<const uint8_t*>(w_packed),
            static_cast<const uint8_t*>(w_scales), w_senc, offsets, out_addr, out_rows, E, N, K};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (variant) {
#define DM_NVFP4_CASE(R, NT, W, P, S) \
  case (S - 1) * 100000 + R * 1000 + NT * 100 + W * 10 + P: return launch<R, NT, W, P, S>(args, s);
    DM_NVFP4_VARIANTS(DM_NVFP4_CASE)
#undef DM_NVFP4_CASE
    default: return 1;
  }
}

// the variants' codes, for the Python side: n codes into out[0 .. n), returns how many exist
extern "C" int dm_nvfp4_decode_mm_variants(int* out, int n) {
  int all[] = {
#define DM_NVFP4_CODE(R, NT, W, P, S) (S - 1) * 100000 + R * 1000 + NT * 100 + W * 10 + P,
      DM_NVFP4_VARIANTS(DM_NVFP4_CODE)
#undef DM_NVFP4_CODE
  };
  const int count = sizeof(all) / sizeof(all[0]);
  for (int i = 0; i < count && i < n; ++i) out[i] = all[i];
  return count;
}
