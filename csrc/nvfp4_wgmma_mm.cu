// NVFP4 grouped GEMM on Hopper's wgmma, for everything above the decode regime (inference,
// tens to thousands of token rows per expert):
//   out[r, n] = S_dec(r) * S_dec(e) * sum_k a16[r, k] * dequant(W[e])[n, k]
// the contract of nvfp4_decode_mm.cu (and of the Triton nvfp4_grouped_mm with a16), with one
// difference: a16 holds each 128-wide chunk of a row in the fragment order below
// (quant_nvfp4.dequantize_rows(..., order="fragment")), not in k order.
//
// Why: with many rows per expert the GEMM is compute-bound, and the weights must be decoded
// once per (weight tile, token tile) without a detour through shared memory. wgmma takes its
// A operand from registers, in the layout of mma.sync.m16n8k16's A per warp: the weights are
// A (64 rows per warpgroup), decoded by each thread straight into its fragment from 16-byte
// loads exactly as nvfp4_decode_mm.cu does, and the tokens are B, copied (cp.async) into
// shared memory in the 128-byte-swizzled K-major layout wgmma reads.
//
// The k order: thread (g, q) of a warp loads the 32 values [32q, 32q + 32) of its rows per
// 128-wide chunk; k16 step s of the chunk takes values 32q + 4s + {0, 2} into fragment columns
// 2q + {0, 1} and 32q + 4s + {1, 3} into 8 + 2q + {0, 1}. So the chunk's position
// p = 16s + 8o + 2q + j holds logical value 32q + 4s + 2j + o (o, j in {0, 1}); a16 is written
// in that order, and wgmma's k walk over shared memory meets the same values.
//
// Schedule: a block of two consumer warpgroups owns a tile of BM = 2 * MT * 64 weight rows x BN
// tokens of one expert; tiles are ordered weight strip by weight strip, token tiles fastest
// (blocks running together share a strip's weights in L2) and walked by a persistent grid of
// one block per SM, or (stream-K, below) cut into equal ranges of 128-wide k chunks, one per
// block, with BPS blocks per SM. Per 128-wide chunk: the token stage is copied S - 2 chunks ahead (S
// stages), the weights one chunk ahead into a register ring or (SW) with the tokens into the
// stage, read from there at the chunk's start; per 32-bit word of the weights
// (two k16 steps) a warpgroup decodes its fragments while the previous word's wgmmas run
// (wait_group 1; the registers of an in-flight wgmma are kept live until it is waited for).
// The epilogue scales the fp32 sums (x 2^6 x S_dec(row) x S_dec(e), the other kernels' order),
// stages the bf16 tile in shared memory and stores 16-byte row pieces ("store": out row r,
// "scatter": the row at out_rows[r], skipped where 0). Nothing is read on the host; a call is
// one launch and can be captured in a CUDA graph.

#include <array>

#include "nvfp4_decode.cuh"

namespace dm_nvfp4 {
namespace wgmma_mm {

constexpr int kThreads = 256;   // two consumer warpgroups
constexpr int kMaxExperts = 256;

// D (64 x BN fp32, BN / 2 per thread) += A (64 x 16 fp16, four registers per thread, the
// m16n8k16 A layout per warp) x B (16 x BN fp16 in shared memory, the descriptor's)
template <int BN>
__device__ __forceinline__ void wgmma(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc);

template <>
__device__ __forceinline__ void wgmma<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma<256>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// a register an in-flight wgmma reads (or writes) stays untouched until here
__device__ __forceinline__ void keep(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// copies written through the generic proxy, read by wgmma through the async proxy
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups
// 1024 bytes apart (the leading offset is unused in this layout)
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// one chunk's weights of a thread: rows g and g + 8 of each of its MT 64-row tiles (16 bytes,
// 32 values each) and their two block scales
template <int MT>
struct WChunk {
  uint4 w[MT][2];
  uint16_t s[MT];
};

template <int MT>
__device__ __forceinline__ void load_weights(WChunk<MT>& c, const uint8_t* const (&w_row)[MT][2],
                                             const uint8_t* const (&s_row)[MT], int chunk, int q) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) c.w[m][h] = ld_weights(w_row[m][h] + chunk * (kChunk / 2) + 16 * q);
    c.s[m] = __ldg(reinterpret_cast<const uint16_t*>(s_row[m] + chunk * (kChunk / 16) + 2 * q));
  }
}

__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint16_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

// A stage: the chunk's token rows (two 64-value columns of BN rows, 128-byte swizzled), and
// with SW its weight rows (kRows x 64 bytes) and their scales (8 bytes per 16-row tile, the
// region padded to keep stages 1024-byte aligned)
template <int BN, int MT, int S, bool SW>
struct Shape {
  static constexpr int kRows = 2 * MT * 64;              // weight rows of a block tile
  static constexpr int kAtom = BN * 128;                 // one 64-value column of a stage
  static constexpr int kWeights = 2 * kAtom;             // offset of the weight rows
  static constexpr int kScales = kWeights + (SW ? kRows * 64 : 0);
  static constexpr int kStage = kScales + (SW ? 1024 : 0);
  static constexpr int kPitch = kRows + 8;               // bf16 per staged output row
  static constexpr int kAhead = S - 2;                   // chunks copied ahead
  static constexpr int kSmem = S * kStage + 1024;        // + alignment slack
  static_assert(kRows / 16 * 8 <= 1024, "a stage's scales fit their region");
  static_assert(S >= 3, "S - 2 chunks ahead, and the stage one chunk behind still in use");
  static_assert(BN * kPitch * 2 <= S * kStage, "the output tile is staged in the token stages");
};

// Stream-K (SK): the grid splits the (tile, chunk) units of the whole GEMM into equal
// contiguous ranges, one per block, instead of walking whole tiles. With few tiles per SM
// (the decode regime: 144 tiles of W13 on 132 SMs) whole tiles leave most SMs idle for the
// last round; equal ranges keep every SM streaming weights to the end. A tile cut by a range
// boundary is summed by the block holding its last chunk (the finisher): each earlier block
// stores its fp32 partial sum in its slot of the workspace, in the accumulator's register
// order (coalesced, no shuffles), and raises its flag; the finisher waits for the flags of
// the lower blocks only, adds their sums in descending block order (a fixed order: the result
// is the same every run) and resets the flags for the next launch. Each block runs its partial
// segment first, so a finisher never waits for more than a segment of its predecessor's work.
// A block's index in this order is a ticket taken when it starts (an atomic counter, reset by
// the last block to finish), not blockIdx: every lower ticket belongs to a block that is
// already running, so a wait always ends, even where blocks start out of order or not all
// blocks fit on the GPU at once (other streams' kernels).
// A finisher that waits too long (a predecessor that never ran) records the verdict in the
// status word, (CHECK_WAIT_TIMEOUT, WAIT_STREAMK_PARTIAL x 2^32 + tile, the block waited for,
// polls), the layout of kernels/checks.py, gives up and finishes its tile without that sum;
// the caller's check_status, stream-ordered after the GEMM, traps with the message. (No printf
// here: a call anywhere in the kernel makes ptxas serialize every wgmma.)
struct Split {
  float* partials;     // [gridDim.x][MT][BN / 2][kThreads] fp32
  int* flags;          // [gridDim.x], 0 between launches
  long long* status;   // [4], 0 until a wait gives up
  int* tickets;        // [2]: tickets taken, blocks done; 0 between launches
  long long polls_max;
};
// the flags' region is sized for this many blocks per SM whatever the variant, so that one
// workspace serves every variant (the partial tiles start at the same place)
constexpr int kMaxBlocksPerSm = 2;
constexpr long long kCheckWaitTimeout = 7;   // checks.CHECK_WAIT_TIMEOUT
constexpr long long kWaitStreamK = 3;        // checks.WAIT_STREAMK_PARTIAL
constexpr int kBusyPolls = 256;              // checks.BUSY_POLLS: then ~1 us per poll

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// SW: the weights are copied into the stages with the tokens (cp.async) instead of loaded
// into a two-chunk register ring, so the proxy fence before each chunk has no register loads
// to wait for
// P: chunks of the weight register ring (without SW), P - 1 of them in flight; BPS: blocks
// per SM
template <int BN, int MT, int S, bool SW, bool SK, int P, int BPS>
__global__ void __launch_bounds__(kThreads, BPS) nvfp4_wgmma_mm_kernel(Args args, Split split) {
  using Sh = Shape<BN, MT, S, SW>;
  static_assert(BPS <= kMaxBlocksPerSm, "the workspace's flags are sized for kMaxBlocksPerSm");
  constexpr int FB = 2;   // words whose fragments are held: one word's wgmmas in flight
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_end[kMaxExperts];   // cumulative tile counts
  __shared__ float s_tok[BN];
  __shared__ int s_seen;     // stream-K: whether the awaited partial sum arrived
  __shared__ int s_ticket;   // stream-K: this block's index in the split
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const int N = args.N, K = args.K, E = args.E;
  const int chunks = K / kChunk;
  const int strips = (N + Sh::kRows - 1) / Sh::kRows;
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int e = 0; e < E; ++e) {
      sum += (args.offsets[e + 1] - args.offsets[e] + BN - 1) / BN * strips;
      tile_end[e] = sum;
    }
  }
  __syncthreads();
  const int total = tile_end[E - 1];
  const int tid = threadIdx.x, wg = tid / 128, wi = tid % 128 / 32, lane = tid % 32;
  const int g = lane / 4, q = lane % 4;
  const __half* a16 = reinterpret_cast<const __half*>(*args.a16_addr);
  const uint8_t* a_rows = reinterpret_cast<const uint8_t*>(*args.a_addr);
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(smem);

  // tile t's expert, the expert's row end, weight strip and first token row
  auto locate = [&](int t) {
    int e = 0;
    while (tile_end[e] <= t) ++e;
    const int r0 = args.offsets[e], r1 = args.offsets[e + 1];
    const int m_tiles = (r1 - r0 + BN - 1) / BN;
    const int local = t - (e > 0 ? tile_end[e - 1] : 0);
    return std::array<int, 4>{e, r1, local / m_tiles, r0 + local % m_tiles * BN};
  };

  float acc[MT][BN / 2];
  // acc = the sums of tile t over chunks [c0, c1)
  auto mainloop = [&](int t, int c0, int c1) {
    const auto [e, r1, strip, tok0] = locate(t);

    const uint8_t* w_row[MT][2];
    const uint8_t* s_row[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      // N % 16 == 0: a 16-row tile is whole or past N (then it reads tile 0, never stored)
      int tile_row = strip * Sh::kRows + wg * MT * 64 + 64 * m + 16 * wi;
      tile_row = tile_row < N ? tile_row : 0;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w_row[m][h] = args.w_packed + ((int64_t)e * N + tile_row + g + 8 * h) * (K / 2);
      s_row[m] = args.w_scales + ((int64_t)e * (N / 16) + tile_row / 16) * (K / 16);
    }
    // A chunk's 16-byte pieces p = tid + kThreads * j of this thread (a whole number per
    // thread): kThreads is a multiple of 16 and of 4, so the piece's column (p % 16 of a token
    // row, p % 4 of a weight row) is the same for every j and its row steps by a constant.
    // Everything but the chunk's column offset is computed once per tile, not per chunk.
    static_assert(BN * 16 % kThreads == 0 && Sh::kRows * 4 % kThreads == 0,
                  "whole pieces per thread");
    constexpr int kTokPieces = BN * 16 / kThreads, kWPieces = Sh::kRows * 4 / kThreads;
    const int tok_n = tid / 16, tok_i = tid % 16;
    const uint32_t tok_dst =
        tok_i / 8 * Sh::kAtom + tok_n * 128 + ((tok_i % 8) ^ (tok_n % 8)) * 16;
    const __half* const tok_src = a16 + tok_i * 8;
    const int sw_row = tid / 4, sw_i = tid % 4;   // SW: the weight rows' pieces
    auto copy_tokens = [&](int c) {   // chunk c of the tile's rows into stage c % S
      const uint32_t st = smem_u32 + (c % S) * Sh::kStage;
#pragma unroll
      for (int j = 0; j < kTokPieces; ++j) {   // token row n = tok_n + 16 j of the tile
        // past the expert: its last row, never stored
        const int r = min(tok0 + tok_n + 16 * j, r1 - 1);
        cp_async16(st + tok_dst + j * 16 * 128, tok_src + (int64_t)r * K + c * kChunk);
      }
      if constexpr (SW) {
#pragma unroll
        for (int j = 0; j < kWPieces; ++j) {   // weight row sw_row + kThreads / 4 * j
          const int row = sw_row + kThreads / 4 * j;
          int wrow = strip * Sh::kRows + row;
          wrow = wrow < N ? wrow : row % 16;     // past N: rows of tile 0, never stored
          cp_async16(st + Sh::kWeights + row * 64 + sw_i * 16,
                     args.w_packed + ((int64_t)e * N + wrow) * (K / 2) + c * (kChunk / 2) +
                         sw_i * 16);
        }
        if (tid < Sh::kRows / 16) {
          int tile = strip * Sh::kRows / 16 + tid;
          tile = tile < N / 16 ? tile : 0;
          cp_async8(st + Sh::kScales + tid * 8,
                    args.w_scales + ((int64_t)e * (N / 16) + tile) * (K / 16) + c * (kChunk / 16));
        }
      }
    };

#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[m][i] = 0.0f;
    uint32_t frag[FB][MT][2][4] = {};   // [word % FB][tile][k16 step of the word][register]

#pragma unroll
    for (int c = 0; c < Sh::kAhead; ++c) {
      if (c0 + c < c1) copy_tokens(c0 + c);
      cp_async_commit();
    }
    WChunk<MT> ring[SW ? 1 : P];
    if constexpr (!SW) {
#pragma unroll
      for (int p = 0; p < P - 1; ++p)
        if (c0 + p < c1) load_weights(ring[p], w_row, s_row, c0 + p, q);
    }

    for (int cb = c0; cb < c1; cb += P) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int c = cb + p;
        if (c >= c1) break;
        cp_async_wait<Sh::kAhead - 1>();   // this thread's copies of chunk c have landed
        fence_async_smem();
        // every thread's copies of chunk c are visible, and every warpgroup is past chunk
        // c - 2 (at most the last word of c - 1 in flight): its stage can be refilled
        __syncthreads();
        if (c + Sh::kAhead < c1) copy_tokens(c + Sh::kAhead);
        cp_async_commit();
        const uint32_t st = smem_u32 + (c % S) * Sh::kStage;
        // the stage's descriptor; a k16 step's is this plus its offset / 16 (smem_desc's address
        // field holds addr / 16 and shared addresses stay below 2^18, so the sum never carries)
        const uint64_t st_desc = smem_desc(st);
        if constexpr (SW) {   // this thread's fragment bytes of the staged weight rows
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            const int row = wg * MT * 64 + 64 * m + 16 * wi;
#pragma unroll
            for (int h = 0; h < 2; ++h)
              ring[0].w[m][h] = lds128(st + Sh::kWeights + (row + g + 8 * h) * 64 + 16 * q);
            ring[0].s[m] = lds16(st + Sh::kScales + row / 16 * 8 + 2 * q);
          }
        } else if (c + P - 1 < c1) {
          load_weights(ring[(p + P - 1) % P], w_row, s_row, c + P - 1, q);
        }
        const WChunk<MT>& wc = ring[SW ? 0 : p];
        uint32_t scale[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m) block_scales(wc.s[m], scale[m]);
#pragma unroll
        for (int v = 0; v < 4; ++v) {   // word v: k16 steps 2v and 2v + 1 of the chunk
          const int b = v % FB;
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            uint32_t ag[4], ah[4];
            decode_word((&wc.w[m][0].x)[v], scale[m][v / 2], ag);   // row g
            decode_word((&wc.w[m][1].x)[v], scale[m][v / 2], ah);   // row g + 8
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              frag[b][m][h][0] = ag[2 * h];
              frag[b][m][h][1] = ah[2 * h];
              frag[b][m][h][2] = ag[2 * h + 1];
              frag[b][m][h][3] = ah[2 * h + 1];
            }
          }
          wgmma_fence();
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int s = 2 * v + h;
            const uint64_t desc = st_desc + (s / 4 * Sh::kAtom + s % 4 * 32) / 16;
#pragma unroll
            for (int m = 0; m < MT; ++m) wgmma<BN>(acc[m], frag[b][m][h], desc);
          }
          wgmma_commit();
          // the oldest word's wgmmas are done: its fragments (the next word's) are free
          wgmma_wait<FB - 1>();
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int i = 0; i < 4; ++i) keep(frag[(b + 1) % FB][m][h][i]);
        }
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) keep(acc[m][i]);
    cp_async_wait<0>();
    __syncthreads();   // the stages are free: the output tile may be staged there
  };

  // the scaled bf16 tile t from acc
  auto store = [&](int t) {
    const auto [e, r1, strip, tok0] = locate(t);
    if (tid < BN) {
      const int r = tok0 + tid;
      s_tok[tid] = r < r1 ? *reinterpret_cast<const float*>(a_rows + (int64_t)r * args.a_stride
                                                            + K / 2 + K / 16)
                          : 0.0f;
    }
    // S_dec = 1 / S_enc correctly rounded, read per tile (a graph replay sees weights updated
    // in place)
    const float w_dec = __frcp_rn(args.w_senc[e]);
    __syncthreads();
    // acc[m][4j + i]: weight row 64m + 16wi + g + 8 (i / 2) of the warpgroup's rows, token
    // 8j + 2q + i % 2 of the tile
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int col = wg * MT * 64 + 64 * m + 16 * wi + g;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = 8 * j + 2 * q + i % 2;
          staged[n * Sh::kPitch + col + 8 * (i / 2)] =
              __float2bfloat16_rn(acc[m][4 * j + i] * kUnscale * s_tok[n] * w_dec);
        }
    }
    __syncthreads();
    constexpr int kPieces = Sh::kRows / 8;   // 16-byte pieces of a staged row
    for (int p = tid; p < BN * kPieces; p += kThreads) {
      const int n = p / kPieces, col = strip * Sh::kRows + p % kPieces * 8;
      const int r = tok0 + n;
      if (r >= r1 || col >= N) continue;
      __nv_bfloat16* o;
      if (args.out_rows != nullptr) {
        const int64_t addr = args.out_rows[r];
        if (addr == 0) continue;
        o = reinterpret_cast<__nv_bfloat16*>(addr);
      } else {
        o = reinterpret_cast<__nv_bfloat16*>(*args.out_addr) + (int64_t)r * N;
      }
      *reinterpret_cast<uint4*>(o + col) =
          *reinterpret_cast<const uint4*>(staged + n * Sh::kPitch + p % kPieces * 8);
    }
    __syncthreads();   // the next tile's copies rewrite the stages
  };

  if constexpr (!SK) {
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      mainloop(t, 0, chunks);
      store(t);
    }
  } else {
    constexpr int kSlot = MT * (BN / 2) * kThreads;   // floats of a block's partial sum
    if (tid == 0) s_ticket = atomicAdd(split.tickets, 1);
    __syncthreads();
    const int b = s_ticket;
    const int64_t units = (int64_t)total * chunks;
    auto start_of = [&](int bb) { return (int64_t)bb * units / gridDim.x; };
    const int64_t u0 = start_of(b), u1 = start_of(b + 1);
    auto done = [&]() {   // the last block to finish resets the tickets for the next launch
      if (tid == 0 && atomicAdd(split.tickets + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        split.tickets[0] = 0;
        split.tickets[1] = 0;
      }
    };
    if (u0 == u1) {
      done();
      return;
    }
    const int t_first = static_cast<int>(u0 / chunks), t_last = static_cast<int>((u1 - 1) / chunks);
    const bool starts_inside = u0 % chunks != 0;   // t_first began in a lower block
    const bool ends_inside = u1 % chunks != 0;     // t_last goes on in a higher block
    auto publish = [&]() {   // this block's partial sum of t_last, for its finisher
      float* slot = split.partials + (int64_t)b * kSlot;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) slot[(m * (BN / 2) + i) * kThreads + tid] = acc[m][i];
      __syncthreads();
      if (tid == 0) st_release(split.flags + b, 1);
    };
    auto finish = [&](int t) {   // add the lower blocks' sums of tile t, then store it
      const int64_t t_start = (int64_t)t * chunks;
      for (int bb = b - 1; bb >= 0; --bb) {
        const int64_t s0 = start_of(bb);
        if (s0 < start_of(bb + 1)) {
          if (tid == 0) {
            long long polls = 0;
            int seen = ld_acquire(split.flags + bb);
            while (seen == 0 && polls < split.polls_max) {
              if (polls >= kBusyPolls) {
                __nanosleep(1000);
                // another wait gave up already: so does this one
                if (*reinterpret_cast<volatile long long*>(split.status) != 0)
                  polls = split.polls_max - 1;
              }
              seen = ld_acquire(split.flags + bb);
              ++polls;
            }
            if (seen != 0) {
              split.flags[bb] = 0;   // read once: clean for the next launch
            } else if (atomicCAS(reinterpret_cast<unsigned long long*>(split.status), 0ull,
                                 static_cast<unsigned long long>(kCheckWaitTimeout)) == 0ull) {
              // the first block to give up writes the numbers (check_status reads them in a
              // later launch)
              split.status[1] = (kWaitStreamK << 32) + t;
              split.status[2] = bb;
              split.status[3] = polls;
            }
            s_seen = seen;
          }
          __syncthreads();
          const bool arrived = s_seen != 0;
          __syncthreads();   // every thread has read s_seen before thread 0 writes it again
          const float* slot = split.partials + (int64_t)bb * kSlot;
          if (arrived) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
              for (int i = 0; i < BN / 2; ++i)
                acc[m][i] += __ldcg(slot + (m * (BN / 2) + i) * kThreads + tid);
          }
        }
        if (s0 <= t_start) break;
      }
      store(t);
    };
    const int c_end = static_cast<int>(u1 - (int64_t)t_last * chunks);
    const int c_begin = static_cast<int>(u0 - (int64_t)t_first * chunks);
    if (t_first == t_last) {
      mainloop(t_first, c_begin, c_end);
      if (ends_inside) publish();
      else if (starts_inside) finish(t_first);
      else store(t_first);
    } else {
      // the partial segment first: the next block's finisher waits for it
      mainloop(t_last, 0, c_end);
      if (ends_inside) publish();
      else store(t_last);
      for (int t = t_first + 1; t < t_last; ++t) {
        mainloop(t, 0, chunks);
        store(t);
      }
      mainloop(t_first, c_begin, chunks);
      if (starts_inside) finish(t_first);
      else store(t_first);
    }
    done();
  }
}

template <int BN, int MT, int S, bool SW, bool SK, int P, int BPS>
int launch(const Args& args, const Split& split, cudaStream_t stream) {
  using Sh = Shape<BN, MT, S, SW>;
  auto kernel = nvfp4_wgmma_mm_kernel<BN, MT, S, SW, SK, P, BPS>;
  static bool configured = false;   // per instance: the dynamic shared memory it needs
  if (!configured) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSmem) !=
        cudaSuccess)
      return 5;
    configured = true;
  }
  if (SK && (split.partials == nullptr || split.flags == nullptr || split.status == nullptr ||
             split.tickets == nullptr || split.polls_max < 1))
    return 1;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 5;
  kernel<<<sms * BPS, kThreads, Sh::kSmem, stream>>>(args, split);
  return cudaGetLastError() == cudaSuccess ? 0 : 5;
}

}  // namespace wgmma_mm
}  // namespace dm_nvfp4

// variant = 10,000,000 * (blocks per SM - 1) + 1,000,000 * (1 + 4 SW + 2 SK) + 100,000 *
// (ring chunks - 2) + token rows per tile * 100 + 64-row weight tiles per warpgroup * 10 +
// token stages
#define DM_NVFP4_WGMMA_VARIANTS(X)                                        \
  X(32, 1, 4, 0, 1, 3, 2) X(64, 2, 4, 0, 1, 2, 1) X(128, 2, 4, 0, 1, 2, 1) \
  X(64, 2, 4, 0, 0, 2, 1) X(128, 2, 4, 1, 0, 2, 1)
#define DM_NVFP4_WGMMA_CODE_OF(BN, MT, S, SW, SK, P, BPS)                            \
  (10000000 * ((BPS) - 1) + 1000000 * (1 + 4 * (SW) + 2 * (SK)) + 100000 * ((P) - 2) + \
   BN * 100 + MT * 10 + S)

// the workspace a stream-K variant needs on a device of `sms` SMs (0 for the others): the status
// word (4 int64), the tickets (2 int32, padded to 32 bytes), one flag per block of the largest
// grid (sms x kMaxBlocksPerSm, padded to 16 bytes), one fp32 partial tile per block of this
// variant's grid; all but the tiles zeroed before the first launch
extern "C" int64_t dm_nvfp4_wgmma_mm_workspace(int variant, int sms) {
  switch (variant) {
#define DM_NVFP4_WGMMA_WS(BN, MT, S, SW, SK, P, BPS)                                    \
  case DM_NVFP4_WGMMA_CODE_OF(BN, MT, S, SW, SK, P, BPS):                               \
    return SK ? 64 + ((int64_t)sms * dm_nvfp4::wgmma_mm::kMaxBlocksPerSm * 4 + 15) / 16 * 16 + \
                    (int64_t)sms * (BPS) * MT * (BN / 2) * dm_nvfp4::wgmma_mm::kThreads * 4   \
              : 0;
    DM_NVFP4_WGMMA_VARIANTS(DM_NVFP4_WGMMA_WS)
#undef DM_NVFP4_WGMMA_WS
    default: return -1;
  }
}

// workspace: dm_nvfp4_wgmma_mm_workspace(variant, sms) bytes, 16-byte aligned (stream-K
// variants; nullptr otherwise); polls_max: the polls (~1 us each past the first 256) a block
// waits for a predecessor's partial sum before it gives up (the status word says so)
extern "C" int dm_nvfp4_wgmma_mm_run(int variant, int E, int N, int K, int64_t a_stride,
                                     const int64_t* a16_addr, const int64_t* a_addr,
                                     const void* w_packed, const void* w_scales,
                                     const float* w_senc, const int32_t* offsets,
                                     const int64_t* out_addr, const int64_t* out_rows,
                                     void* stream, void* workspace, int64_t polls_max) {
  using namespace dm_nvfp4;
  if (E < 1 || E > wgmma_mm::kMaxExperts || N < 16 || N % 16 != 0 || K < kChunk ||
      K % kChunk != 0 || a_stride % 4 != 0)
    return 1;
  if ((out_addr == nullptr) == (out_rows == nullptr)) return 1;
  Args args{a16_addr, a_addr, a_stride, static_cast<const uint8_t*>(w_packed),
            static_cast<const uint8_t*>(w_scales), w_senc, offsets, out_addr, out_rows, E, N, K};
  const bool stream_k = dm_nvfp4_wgmma_mm_workspace(variant, 1) > 0;
  if (stream_k && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 16 != 0))
    return 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 5;
  wgmma_mm::Split split{nullptr, nullptr, nullptr, nullptr, polls_max};
  if (stream_k) {
    // status | tickets | flags (4 bytes per block of the largest grid) | partial tiles
    const int64_t max_blocks = (int64_t)sms * wgmma_mm::kMaxBlocksPerSm;
    uint8_t* base = static_cast<uint8_t*>(workspace);
    split.status = reinterpret_cast<long long*>(base);
    split.tickets = reinterpret_cast<int*>(base + 32);
    split.flags = reinterpret_cast<int*>(base + 64);
    split.partials = reinterpret_cast<float*>(base + 64 + (max_blocks * 4 + 15) / 16 * 16);
  }
  switch (variant) {
#define DM_NVFP4_WGMMA_CASE(BN, MT, S, SW, SK, P, BPS)  \
  case DM_NVFP4_WGMMA_CODE_OF(BN, MT, S, SW, SK, P, BPS): \
    return wgmma_mm::launch<BN, MT, S, SW, SK, P, BPS>(args, split, s);
    DM_NVFP4_WGMMA_VARIANTS(DM_NVFP4_WGMMA_CASE)
#undef DM_NVFP4_WGMMA_CASE
    default: return 1;
  }
}

extern "C" int dm_nvfp4_wgmma_mm_variants(int* out, int n) {
  int all[] = {
#define DM_NVFP4_WGMMA_CODE(BN, MT, S, SW, SK, P, BPS) \
  DM_NVFP4_WGMMA_CODE_OF(BN, MT, S, SW, SK, P, BPS),
      DM_NVFP4_WGMMA_VARIANTS(DM_NVFP4_WGMMA_CODE)
#undef DM_NVFP4_WGMMA_CODE
  };
  const int count = sizeof(all) / sizeof(all[0]);
  for (int i = 0; i < count && i < n; ++i) out[i] = all[i];
  return count;
}
