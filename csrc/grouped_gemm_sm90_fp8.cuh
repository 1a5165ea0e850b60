// FP8 block-scaled grouped GEMMs for Hopper (sm_90a) on CUTLASS 3's ptr-array warp-specialized
// FP8 blockwise kernels: the CUTLASS twins of two contracts of kernels/grouped_gemm/fp8.py.
//
// FPROP (fp8_grouped_mm, epilogue "store"; the W13 FPROP):
//
//   out[r, :] = dequant(qa)[r, :] @ dequant(w[e])^T   for the rows r of expert e
//
//   qa   e4m3 [R, K] at *qa_addr, sa fp32 [R, K/128] at *sa_addr (the A row bundle: one scale
//        per row per 128 of K, K-major)
//   w    e4m3 [E, N, K] contiguous, sw fp32 [E, N/128, K/128] (128 x 128 tile scales, K-major)
//   out  bf16 [R, N] row-major at *out_addr
//
// Each group is an M_e x N x K GEMM over the rows [offsets[e], offsets[e+1]): A_e row-major at
// qa + start * K, B_e "column-major" (w[e] is [N, K], K contiguous), scales
// Sm90BlockwiseScaleConfig<1, 128, 128> K-major on both sides, so group e's A scales start at
// sa + start * K/128 and its B scales at sw + e * N/128 * K/128. A group without rows has no
// tiles. The mainloop promotes every 128 of K: a block's wgmma partial sum times sa[m] * sw[n/128]
// is added to the fp32 accumulator (DeepSeek-V3's recipe, as the Triton kernel computes it).
//
// WGRAD (fp8_grouped_wgrad):
//   out[e] (+)= A_e @ B_e^T,   A_e = dequant(qa)[:, segment e],  B_e = dequant(qb)[:, segment e]
//
//   qa   e4m3 [M, Rp] at *qa_addr, sa fp32 [Rp/128, M] at *sa_addr  ("column bundles": tokens
//   qb   e4m3 [N, Rp] at *qb_addr, sb fp32 [Rp/128, N] at *sb_addr   contiguous, 128 x 1 scales)
//   out  ElementD [E, M, N] contiguous at out, or, when out_table is not null, E row-major M x N
//        matrices at the addresses out_table[e] (int64 [E] on the device)
//
// Expert e's tokens sit in its padded segment: plen_e = ceil(len_e / 128) * 128 columns starting
// at pstart_e = sum of the earlier plen (zeros in the padding). The row stride Rp is
// layout.padded_rows(R, E) of this call's R = offsets[E] (what the quantizer writes with), so it
// is derived on the device like everything else per call.
//
// In CUTLASS terms each group is an M x N x plen_e GEMM: A_e row-major (K contiguous, lda = Rp),
// B_e "column-major" N x K (K contiguous, ldb = Rp), at qa + pstart_e and qb + pstart_e (128-byte
// aligned: pstart_e and Rp are multiples of 128). The scales are Sm90BlockwiseScaleConfig<1, 1,
// 128>: one fp32 per row (column) of A (B) per 128 of K, MN-major, k-block stride M (N), so group
// e's scales start at sa + (pstart_e / 128) * M. The mainloop promotes every 128 of K: each
// block's wgmma partial sum is multiplied by sa[m] * sb[n] and added to the fp32 accumulator.
//
// An expert without tokens still owns its output tiles: it reads a zero block (128 columns, its
// own stride 128, zero scales), so its tiles run one K block of zeros and store exact zeros, or
// add zero when accumulating (CUTLASS leaves the accumulators of a K = 0 tile unset).
//
// Accumulate: the fp32 units have a source operand C = D; beta = 1 adds, beta = 0 stores (the
// epilogue then skips loading C: Sm90ScalarBroadcast::is_zero()). The bf16 units have none.
#pragma once

#include "grouped_gemm_sm90.cuh"   // Status, launch_gemm, the CUTLASS includes

#include "cutlass/detail/blockwise_scale_layout.hpp"

#include "fp8_promotion_overlap.cuh"

namespace dm_sm90 {

using ElementFp8 = cutlass::float_e4m3_t;
constexpr int kFp8Alignment = 16;   // elements per 16-byte TMA access
constexpr int kScaleBlock = 128;    // K of one scaling block
// WGRAD: one scale per row of A (of B) per 128 tokens, MN-major ([Rp/128, M] / [Rp/128, N]).
using Fp8WgradScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kScaleBlock>;
// FPROP: one scale per row of A per 128 of K ([R, K/128]), one per 128 x 128 tile of B
// ([N/128, K/128]), both K-major.
using Fp8FpropScales = cutlass::detail::Sm90BlockwiseScaleConfig<
    1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K, cute::GMMA::Major::K>;

// The device argument block of a call: E pointers each for A, B, SFA, SFB, C, D, then E strides
// each for A, B and C/D, E scale layouts each for SFA and SFB, then E problem shapes (each array
// 16-byte aligned).
template <class StrideA, class StrideB, class StrideD, class LayoutSFA, class LayoutSFB,
          class Shape3>
struct Fp8ArgsLayout {
  size_t ptr_a, ptr_b, ptr_sfa, ptr_sfb, ptr_c, ptr_d, stride_a, stride_b, stride_d, layout_sfa,
      layout_sfb, shapes, bytes;
  static CUTLASS_HOST_DEVICE size_t up(size_t x) { return (x + 15) / 16 * 16; }
  CUTLASS_HOST_DEVICE explicit Fp8ArgsLayout(int E) {
    ptr_a = 0;
    ptr_b = up(ptr_a + E * sizeof(void*));
    ptr_sfa = up(ptr_b + E * sizeof(void*));
    ptr_sfb = up(ptr_sfa + E * sizeof(void*));
    ptr_c = up(ptr_sfb + E * sizeof(void*));
    ptr_d = up(ptr_c + E * sizeof(void*));
    stride_a = up(ptr_d + E * sizeof(void*));
    stride_b = up(stride_a + E * sizeof(StrideA));
    stride_d = up(stride_b + E * sizeof(StrideB));
    layout_sfa = up(stride_d + E * sizeof(StrideD));
    layout_sfb = up(layout_sfa + E * sizeof(LayoutSFA));
    shapes = up(layout_sfb + E * sizeof(LayoutSFB));
    bytes = up(shapes + E * sizeof(Shape3));
  }
};

// One configuration: the scale layout (Fp8WgradScales or Fp8FpropScales), ElementD out (bf16 or
// fp32), with a source operand C = D when kSource (the accumulating fp32 units), on the given
// tile, cluster and kernel / epilogue schedules, on CUTLASS's mainloop with the overlapped
// promotion (Fp8PromotionOverlapMainloop). A is row-major M x K, B "column-major" K x N (both K
// contiguous), D row-major.
template <class Scales, class ElementD_, bool kSource, class TileShape_, class ClusterShape_,
          class KernelSchedule_, class EpilogueSchedule_>
struct Fp8Gemm {
  using ScaleConfig = Scales;
  using LayoutSFA = decltype(Scales::deduce_layoutSFA());
  using LayoutSFB = decltype(Scales::deduce_layoutSFB());
  using ElementD = ElementD_;
  using ElementC = cute::conditional_t<kSource, ElementD, void>;
  static constexpr bool kHasSource = kSource;
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_, ClusterShape_,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, LayoutD*, kAlignmentD,
      ElementD, LayoutD*, kAlignmentD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementFp8, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kFp8Alignment,
      ElementFp8, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kFp8Alignment,
      float, TileShape_, ClusterShape_,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;
  using CollectiveMainloop = Fp8PromotionOverlapMainloop<BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(cute::is_same_v<StrideC, StrideD>, "C and D share their stride array");
  using ElementCArg = typename CollectiveEpilogue::ElementC;   // void without a source
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using Layout = Fp8ArgsLayout<StrideA, StrideB, StrideD, LayoutSFA, LayoutSFB, Shape3>;

  // beta = 1: out += result (kSource only); 0: out = result.
  static typename Gemm::Arguments arguments(int E, char* args, int device, int sm_count,
                                            float beta = 0.0f) {
    Layout L(E);
    typename Gemm::Arguments arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {E, reinterpret_cast<Shape3*>(args + L.shapes), nullptr},
        {reinterpret_cast<ElementFp8 const**>(args + L.ptr_a),
         reinterpret_cast<StrideA*>(args + L.stride_a),
         reinterpret_cast<ElementFp8 const**>(args + L.ptr_b),
         reinterpret_cast<StrideB*>(args + L.stride_b),
         reinterpret_cast<float const**>(args + L.ptr_sfa),
         reinterpret_cast<LayoutSFA*>(args + L.layout_sfa),
         reinterpret_cast<float const**>(args + L.ptr_sfb),
         reinterpret_cast<LayoutSFB*>(args + L.layout_sfb)},
        {{},
         kSource ? reinterpret_cast<ElementCArg const**>(args + L.ptr_c) : nullptr,
         reinterpret_cast<StrideD*>(args + L.stride_d),
         reinterpret_cast<ElementD**>(args + L.ptr_d),
         reinterpret_cast<StrideD*>(args + L.stride_d)}};
    arguments.epilogue.thread.alpha = 1.0f;
    arguments.epilogue.thread.beta = beta;
    arguments.hw_info.device_id = device;
    arguments.hw_info.sm_count = sm_count;
    return arguments;
  }
};

template <class ElementD, bool kSource, class TileShape, class ClusterShape, class KernelSchedule,
          class EpilogueSchedule>
using Fp8WgradGemm = Fp8Gemm<Fp8WgradScales, ElementD, kSource, TileShape, ClusterShape,
                             KernelSchedule, EpilogueSchedule>;

// The FPROP units store bf16 and have no source operand.
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
using Fp8FpropGemm = Fp8Gemm<Fp8FpropScales, cutlass::bfloat16_t, false, TileShape, ClusterShape,
                             KernelSchedule, EpilogueSchedule>;

// Rp of this call, layout.padded_rows(R, E) with R = offsets[E]: the column bundles' row stride.
__device__ inline int64_t padded_rows(const int32_t* offsets, int E) {
  return (int64_t(offsets[E]) + int64_t(kScaleBlock - 1) * E + kScaleBlock - 1) / kScaleBlock *
         kScaleBlock;
}

// One thread per expert: shapes, pointers, strides and scale layouts of its group. Traps on
// offsets that are not cumulative row ends, or on a padded row space wider than the bundles'
// allocation (rp_cap: their second dimension, a host value; 0 when unknown).
template <class G>
__global__ void fill_fp8_wgrad_args(int E, int M, int N, int64_t rp_cap, const int32_t* offsets,
                                    const int64_t* qa_addr, const int64_t* sa_addr,
                                    const int64_t* qb_addr, const int64_t* sb_addr,
                                    void* out, const int64_t* out_table, const void* zeros,
                                    char* args) {
  typename G::Layout L(E);
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t pstart = 0;
  for (int i = 0; i <= e; ++i) {
    int start = offsets[i], end = offsets[i + 1];
    if (start < 0 || end < start) {
      printf("grouped_fp8_wgrad_sm90: expert_offsets[%d]=%d, expert_offsets[%d]=%d are not "
             "cumulative row ends\n", i, start, i + 1, end);
      __trap();
    }
    if (i < e) pstart += (int64_t(end - start) + kScaleBlock - 1) / kScaleBlock * kScaleBlock;
  }
  int len = offsets[e + 1] - offsets[e];
  int K = (len + kScaleBlock - 1) / kScaleBlock * kScaleBlock;
  int64_t rp = padded_rows(offsets, E);
  if (rp_cap > 0 && rp > rp_cap) {
    printf("grouped_fp8_wgrad_sm90: %lld padded rows (offsets[E]=%d) exceed the bundles' %lld\n",
           static_cast<long long>(rp), offsets[E], static_cast<long long>(rp_cap));
    __trap();
  }
  auto const* qa = reinterpret_cast<ElementFp8 const*>(*qa_addr) + pstart;
  auto const* qb = reinterpret_cast<ElementFp8 const*>(*qb_addr) + pstart;
  auto const* sa = reinterpret_cast<float const*>(*sa_addr) + pstart / kScaleBlock * M;
  auto const* sb = reinterpret_cast<float const*>(*sb_addr) + pstart / kScaleBlock * N;
  int64_t ld = rp;
  if (K == 0) {   // one block of zeros: data [max(M, N), 128] with stride 128, zero scales
    qa = qb = static_cast<ElementFp8 const*>(zeros);
    sa = sb = static_cast<float const*>(zeros);
    K = kScaleBlock;
    ld = kScaleBlock;
  }
  using ElementD = typename G::ElementD;
  ElementD* d = out_table ? reinterpret_cast<ElementD*>(out_table[e])
                          : static_cast<ElementD*>(out) + int64_t(e) * M * N;
  reinterpret_cast<ElementFp8 const**>(args + L.ptr_a)[e] = qa;
  reinterpret_cast<ElementFp8 const**>(args + L.ptr_b)[e] = qb;
  reinterpret_cast<float const**>(args + L.ptr_sfa)[e] = sa;
  reinterpret_cast<float const**>(args + L.ptr_sfb)[e] = sb;
  reinterpret_cast<ElementD const**>(args + L.ptr_c)[e] = d;
  reinterpret_cast<ElementD**>(args + L.ptr_d)[e] = d;
  auto stride_a = cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(M, K, 1));
  auto stride_b = cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(N, K, 1));
  cute::get<0>(stride_a) = ld;   // K contiguous; the next row (of M or N) is ld further
  cute::get<0>(stride_b) = ld;
  reinterpret_cast<typename G::StrideA*>(args + L.stride_a)[e] = stride_a;
  reinterpret_cast<typename G::StrideB*>(args + L.stride_b)[e] = stride_b;
  reinterpret_cast<typename G::StrideD*>(args + L.stride_d)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(M, N, 1));
  // k-block strides M and N: the bundles' [Rp/128, M] / [Rp/128, N] scales, m (n) contiguous.
  // The grouped mainloop rebuilds these from the problem shape (same values); kept for the
  // arguments' contract.
  reinterpret_cast<typename G::LayoutSFA*>(args + L.layout_sfa)[e] =
      G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
  reinterpret_cast<typename G::LayoutSFB*>(args + L.layout_sfb)[e] =
      G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
  reinterpret_cast<typename G::Shape3*>(args + L.shapes)[e] = typename G::Shape3(M, N, K);
}

template <class G>
int64_t fp8_workspace_bytes(int E, int sm_count) {
  auto arguments = G::arguments(E, nullptr, 0, sm_count);
  return static_cast<int64_t>(G::Gemm::get_workspace_size(arguments));
}

// Bytes of the zero block an empty expert reads: max(M, N) rows of 128 e4m3 zeros (its scales
// read the block's first max(M, N) fp32 words, zeros as well).
inline int64_t fp8_zero_bytes(int M, int N) {
  return int64_t(M > N ? M : N) * kScaleBlock;
}

// FPROP: one thread per expert, its group's shape, pointers, strides and scale layouts over its
// rows (see the FPROP contract at the top). Traps on offsets that are not cumulative row ends
// or that end past the row bound (r_cap: the rows the A bundle and out were allocated for, a
// host value; -1 when unknown).
template <class G>
__global__ void fill_fp8_fprop_args(int E, int N, int K, int64_t r_cap, const int32_t* offsets,
                                    const int64_t* qa_addr, const int64_t* sa_addr,
                                    const ElementFp8* w, const float* sw,
                                    const int64_t* out_addr, char* args) {
  typename G::Layout L(E);
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int start = offsets[e], end = offsets[e + 1];
  if (start < 0 || end < start) {
    printf("grouped_fp8_fprop_sm90: expert_offsets[%d]=%d, expert_offsets[%d]=%d are not "
           "cumulative row ends\n", e, start, e + 1, end);
    __trap();
  }
  if (r_cap >= 0 && end > r_cap) {
    printf("grouped_fp8_fprop_sm90: expert_offsets[%d]=%d exceeds the %lld rows of a and out\n",
           e + 1, end, static_cast<long long>(r_cap));
    __trap();
  }
  int M = end - start;
  int64_t kb = K / kScaleBlock;
  auto const* qa = reinterpret_cast<ElementFp8 const*>(*qa_addr) + int64_t(start) * K;
  auto const* sa = reinterpret_cast<float const*>(*sa_addr) + int64_t(start) * kb;
  using ElementD = typename G::ElementD;
  ElementD* d = reinterpret_cast<ElementD*>(*out_addr) + int64_t(start) * N;
  reinterpret_cast<ElementFp8 const**>(args + L.ptr_a)[e] = qa;
  reinterpret_cast<ElementFp8 const**>(args + L.ptr_b)[e] = w + int64_t(e) * N * K;
  reinterpret_cast<float const**>(args + L.ptr_sfa)[e] = sa;
  reinterpret_cast<float const**>(args + L.ptr_sfb)[e] = sw + int64_t(e) * (N / kScaleBlock) * kb;
  reinterpret_cast<ElementD const**>(args + L.ptr_c)[e] = d;
  reinterpret_cast<ElementD**>(args + L.ptr_d)[e] = d;
  reinterpret_cast<typename G::StrideA*>(args + L.stride_a)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(M, K, 1));
  reinterpret_cast<typename G::StrideB*>(args + L.stride_b)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(N, K, 1));
  reinterpret_cast<typename G::StrideD*>(args + L.stride_d)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(M, N, 1));
  // K-major scales: row m of A has its K/128 scales at sa + m * K/128, the n-block of B its
  // K/128 at sw_e + (n / 128) * K/128 (the mainloop rebuilds these from the shape; same values)
  reinterpret_cast<typename G::LayoutSFA*>(args + L.layout_sfa)[e] =
      G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
  reinterpret_cast<typename G::LayoutSFB*>(args + L.layout_sfb)[e] =
      G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
  reinterpret_cast<typename G::Shape3*>(args + L.shapes)[e] = typename G::Shape3(M, N, K);
}

// out[r] = a[r] @ w[e]^T with block scales (the FPROP contract).
template <class G>
int run_fp8_fprop(int E, int N, int K, int64_t r_cap, const int32_t* offsets,
                  const int64_t* qa_addr, const int64_t* sa_addr, const void* w, const void* sw,
                  const int64_t* out_addr, void* args, void* workspace, int64_t workspace_size,
                  int device, int sm_count, cudaStream_t stream) {
  if (E < 1 || N % kScaleBlock != 0 || K % kScaleBlock != 0 || r_cap < -1) return kBadShape;
  auto arguments = G::arguments(E, static_cast<char*>(args), device, sm_count);
  if (static_cast<int64_t>(G::Gemm::get_workspace_size(arguments)) > workspace_size)
    return kWorkspaceSmall;
  fill_fp8_fprop_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      E, N, K, r_cap, offsets, qa_addr, sa_addr, static_cast<ElementFp8 const*>(w),
      static_cast<float const*>(sw), out_addr, static_cast<char*>(args));
  return launch_gemm<G>(arguments, workspace, stream);
}

// out[e] (+)= A_e @ B_e^T. accumulate needs a source operand (the fp32 units).
template <class G>
int run_fp8_wgrad(int E, int M, int N, int64_t rp_cap, const int32_t* offsets,
                  const int64_t* qa_addr, const int64_t* sa_addr, const int64_t* qb_addr,
                  const int64_t* sb_addr, void* out, const int64_t* out_table, int accumulate,
                  const void* zeros, void* args, void* workspace, int64_t workspace_size,
                  int device, int sm_count, cudaStream_t stream) {
  if (E < 1 || M % kFp8Alignment != 0 || N % kFp8Alignment != 0 || rp_cap < 0 ||
      rp_cap % kScaleBlock != 0 ||
      (accumulate && !G::kHasSource))
    return kBadShape;
  auto arguments = G::arguments(E, static_cast<char*>(args), device, sm_count,
                                accumulate ? 1.0f : 0.0f);
  if (static_cast<int64_t>(G::Gemm::get_workspace_size(arguments)) > workspace_size)
    return kWorkspaceSmall;
  fill_fp8_wgrad_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      E, M, N, rp_cap, offsets, qa_addr, sa_addr, qb_addr, sb_addr, out, out_table, zeros,
      static_cast<char*>(args));
  return launch_gemm<G>(arguments, workspace, stream);
}

}  // namespace dm_sm90

// extern "C" entry points of one FP8 WGRAD configuration, named dm_sm90_fp8_wgrad_<name>_*.
#define DM_SM90_FP8_WGRAD_ENTRY_POINTS(name, G)                                                 \
  extern "C" int64_t dm_sm90_fp8_wgrad_##name##_args_bytes(int E) {                             \
    return static_cast<int64_t>(G::Layout(E).bytes);                                            \
  }                                                                                             \
  extern "C" int64_t dm_sm90_fp8_wgrad_##name##_workspace_bytes(int E, int sm_count) {          \
    return dm_sm90::fp8_workspace_bytes<G>(E, sm_count);                                        \
  }                                                                                             \
  extern "C" int64_t dm_sm90_fp8_wgrad_##name##_zero_bytes(int M, int N) {                      \
    return dm_sm90::fp8_zero_bytes(M, N);                                                       \
  }                                                                                             \
  extern "C" int dm_sm90_fp8_wgrad_##name##_run(                                                \
      int E, int M, int N, int64_t rp_cap, const int32_t* offsets, const int64_t* qa_addr,      \
      const int64_t* sa_addr, const int64_t* qb_addr, const int64_t* sb_addr,                   \
      void* out, const int64_t* out_table, int accumulate, const void* zeros, void* args,       \
      void* workspace, int64_t workspace_size, int device, int sm_count, void* stream) {        \
    return dm_sm90::run_fp8_wgrad<G>(E, M, N, rp_cap, offsets, qa_addr, sa_addr, qb_addr,       \
                                     sb_addr, out, out_table, accumulate, zeros, args,          \
                                     workspace, workspace_size, device, sm_count,               \
                                     static_cast<cudaStream_t>(stream));                        \
  }

// extern "C" entry points of one FP8 FPROP configuration, named dm_sm90_fp8_fprop_<name>_*.
#define DM_SM90_FP8_FPROP_ENTRY_POINTS(name, G)                                                 \
  extern "C" int64_t dm_sm90_fp8_fprop_##name##_args_bytes(int E) {                             \
    return static_cast<int64_t>(G::Layout(E).bytes);                                            \
  }                                                                                             \
  extern "C" int64_t dm_sm90_fp8_fprop_##name##_workspace_bytes(int E, int sm_count) {          \
    return dm_sm90::fp8_workspace_bytes<G>(E, sm_count);                                        \
  }                                                                                             \
  extern "C" int dm_sm90_fp8_fprop_##name##_run(                                                \
      int E, int N, int K, int64_t r_cap, const int32_t* offsets, const int64_t* qa_addr,       \
      const int64_t* sa_addr, const void* w, const void* sw, const int64_t* out_addr,           \
      void* args, void* workspace, int64_t workspace_size, int device, int sm_count,            \
      void* stream) {                                                                           \
    return dm_sm90::run_fp8_fprop<G>(E, N, K, r_cap, offsets, qa_addr, sa_addr, w, sw,         \
                                     out_addr, args, workspace, workspace_size, device,         \
                                     sm_count, static_cast<cudaStream_t>(stream));              \
  }
