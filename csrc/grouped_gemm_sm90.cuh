// Grouped FPROP GEMM for Hopper (sm_90a) on the CUTLASS 3 warp-specialized ptr-array kernels.
//
//   out[r, :] = a[r, :] @ w[e]^T   for the rows r in [offsets[e], offsets[e+1]) of expert e
//
//   a        bf16 [R, K] row-major, at the device address *a_addr (int64 on the device)
//   w        bf16 [E, N, K] contiguous (each w[e] is [N, K], K contiguous)
//   out      bf16 [R, N] row-major, at the device address *out_addr
//   offsets  int32 [E + 1] on the device, cumulative row ends (offsets[0] = 0)
//
// Nothing is read on the host: a one-block kernel turns the device offsets and addresses into
// CUTLASS's per-group problem shapes, pointers and strides (in `args`, a device buffer the caller
// owns), and the GEMM reads them there. So a call is two kernel launches on `stream`, with no
// host synchronisation, and can be captured in a CUDA graph. Groups with no rows get no tiles.
//
// One translation unit per tile configuration includes this header and instantiates
// DM_SM90_FPROP_ENTRY_POINTS(name, Config) (see grouped_gemm_sm90_*.cu); the Python side
// (megatron_dist_moe/kernels/grouped_gemm_sm90.py) builds them into one shared library and calls
// the extern "C" entry points through ctypes (no torch headers, so the build is quick and the
// library does not depend on the torch ABI).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace dm_sm90 {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // a [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // B = w[e]^T is [K, N] with K contiguous
using LayoutD = cutlass::layout::RowMajor;     // out [M, N]
constexpr int kAlignment = 16 / sizeof(Element);

// The device argument block of a grouped call: E pointers each for A, B, D, then E strides each,
// then E problem shapes, each array 16-byte aligned.
template <class StrideA, class StrideB, class StrideD, class Shape3>
struct GroupArgsLayout {
  size_t ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, shapes, bytes;
  static CUTLASS_HOST_DEVICE size_t up(size_t x) { return (x + 15) / 16 * 16; }
  CUTLASS_HOST_DEVICE explicit GroupArgsLayout(int E) {
    ptr_a = 0;
    ptr_b = up(ptr_a + E * sizeof(void*));
    ptr_d = up(ptr_b + E * sizeof(void*));
    stride_a = up(ptr_d + E * sizeof(void*));
    stride_b = up(stride_a + E * sizeof(StrideA));
    stride_d = up(stride_b + E * sizeof(StrideB));
    shapes = up(stride_d + E * sizeof(StrideD));
    bytes = up(shapes + E * sizeof(Shape3));
  }
};

// One CUTLASS 3 ptr-array grouped GEMM: D_e = A_e @ B_e per group, fp32 accumulation, no source
// operand C, ElementD out. FpropGemm and WgradGemm below are its two uses.
template <class ElementD_, class LayoutA_, class LayoutB_, class TileShape_, class ClusterShape_,
          class KernelSchedule_, class EpilogueSchedule_>
struct GroupedGemm {
  using ElementD = ElementD_;
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_, ClusterShape_,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignmentD,       // no source operand C
      ElementD, LayoutD*, kAlignmentD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA_*, kAlignment, Element, LayoutB_*, kAlignment, float,
      TileShape_, ClusterShape_,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using Layout = GroupArgsLayout<StrideA, StrideB, StrideD, Shape3>;

  static typename Gemm::Arguments arguments(int E, char* args, int device, int sm_count) {
    Layout L(E);
    typename Gemm::Arguments arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {E, reinterpret_cast<Shape3*>(args + L.shapes), nullptr},
        {reinterpret_cast<Element const**>(args + L.ptr_a),
         reinterpret_cast<StrideA*>(args + L.stride_a),
         reinterpret_cast<Element const**>(args + L.ptr_b),
         reinterpret_cast<StrideB*>(args + L.stride_b)},
        {{},
         nullptr,
         reinterpret_cast<StrideD*>(args + L.stride_d),
         reinterpret_cast<ElementD**>(args + L.ptr_d),
         reinterpret_cast<StrideD*>(args + L.stride_d)}};
    arguments.epilogue.thread.alpha = 1.0f;
    arguments.epilogue.thread.beta = 0.0f;
    arguments.hw_info.device_id = device;
    arguments.hw_info.sm_count = sm_count;
    return arguments;
  }
};

template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_>
using FpropGemm = GroupedGemm<Element, LayoutA, LayoutB, TileShape_, ClusterShape_,
                              KernelSchedule_, EpilogueSchedule_>;

// Grouped WGRAD: out[e] = a_e^T @ b_e over the rows of expert e, K = that expert's row count.
//
//   a    bf16 [R, M] row-major at *a_addr: A_e = a_e^T is M x K_e with M contiguous (M-major)
//   b    bf16 [R, N] row-major at *b_addr: B_e = b_e   is K_e x N with N contiguous (N-major)
//   out  ElementD [E, M, N] contiguous (bf16 or fp32)
//
// The reduction runs over each expert's ragged row range, so the per-group K differs and the
// last K tile of an expert is partial (TMA fills the rows past its end with zeros). An expert
// with no rows still owns a full output tile grid: its A and B point at a zero block of
// kZeroRows rows, so its tiles run one K tile of zeros and store exact zeros (CUTLASS leaves
// the accumulators of a K = 0 tile unset).
constexpr int kZeroRows = 8;

template <class ElementD_, class TileShape_, class ClusterShape_, class KernelSchedule_,
          class EpilogueSchedule_>
using WgradGemm = GroupedGemm<ElementD_,
                              cutlass::layout::ColumnMajor,  // A_e = a_e^T [M, K_e], M contiguous
                              cutlass::layout::RowMajor,     // B_e = b_e [K_e, N], N contiguous
                              TileShape_, ClusterShape_, KernelSchedule_, EpilogueSchedule_>;

// One thread per expert: the per-group problem shapes, pointers and strides from the device
// offsets and base addresses. Traps on offsets that are not cumulative row ends.
template <class G>
__global__ void fill_group_args(int E, int N, int K, const int32_t* offsets,
                                const int64_t* a_addr, const Element* w, const int64_t* out_addr,
                                char* args) {
  typename G::Layout L(E);
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int start = offsets[e];
  int end = offsets[e + 1];
  if (start < 0 || end < start) {
    printf("grouped_gemm_sm90: expert_offsets[%d]=%d, expert_offsets[%d]=%d are not cumulative "
           "row ends\n", e, start, e + 1, end);
    __trap();
  }
  int M = end - start;
  auto* a = reinterpret_cast<Element const*>(*a_addr);
  auto* out = reinterpret_cast<Element*>(*out_addr);
  reinterpret_cast<Element const**>(args + L.ptr_a)[e] = a + int64_t(start) * K;
  reinterpret_cast<Element const**>(args + L.ptr_b)[e] = w + int64_t(e) * N * K;
  reinterpret_cast<Element**>(args + L.ptr_d)[e] = out + int64_t(start) * N;
  reinterpret_cast<typename G::StrideA*>(args + L.stride_a)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(M, K, 1));
  reinterpret_cast<typename G::StrideB*>(args + L.stride_b)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(N, K, 1));
  reinterpret_cast<typename G::StrideD*>(args + L.stride_d)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(M, N, 1));
  reinterpret_cast<typename G::Shape3*>(args + L.shapes)[e] = typename G::Shape3(M, N, K);
}

// WGRAD: one thread per expert. A_e and B_e start at the expert's first row of a and b, with K
// = its row count; an expert with no rows reads the zero block instead (see WgradGemm).
template <class G>
__global__ void fill_wgrad_args(int E, int M, int N, const int32_t* offsets,
                                const int64_t* a_addr, const int64_t* b_addr,
                                typename G::ElementD* out, const Element* zeros, char* args) {
  typename G::Layout L(E);
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int start = offsets[e];
  int end = offsets[e + 1];
  if (start < 0 || end < start) {
    printf("grouped_wgrad_sm90: expert_offsets[%d]=%d, expert_offsets[%d]=%d are not cumulative "
           "row ends\n", e, start, e + 1, end);
    __trap();
  }
  int K = end - start;
  auto* a = reinterpret_cast<Element const*>(*a_addr) + int64_t(start) * M;
  auto* b = reinterpret_cast<Element const*>(*b_addr) + int64_t(start) * N;
  if (K == 0) {
    a = b = zeros;
    K = kZeroRows;
  }
  reinterpret_cast<Element const**>(args + L.ptr_a)[e] = a;
  reinterpret_cast<Element const**>(args + L.ptr_b)[e] = b;
  reinterpret_cast<typename G::ElementD**>(args + L.ptr_d)[e] = out + int64_t(e) * M * N;
  reinterpret_cast<typename G::StrideA*>(args + L.stride_a)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideA{}, make_shape(M, K, 1));
  reinterpret_cast<typename G::StrideB*>(args + L.stride_b)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideB{}, make_shape(N, K, 1));
  reinterpret_cast<typename G::StrideD*>(args + L.stride_d)[e] =
      cutlass::make_cute_packed_stride(typename G::StrideD{}, make_shape(M, N, 1));
  reinterpret_cast<typename G::Shape3*>(args + L.shapes)[e] = typename G::Shape3(M, N, K);
}

// Status codes returned to Python (grouped_gemm_sm90.py names them).
enum Status : int {
  kOk = 0,
  kBadShape = 1,        // N or K (WGRAD: M or N) not a multiple of 8, or E < 1
  kWorkspaceSmall = 2,  // the workspace passed is smaller than workspace_bytes()
  kCannotImplement = 3, // CUTLASS can_implement failed
  kInitFailed = 4,      // CUTLASS initialize failed
  kLaunchFailed = 5,    // a kernel launch failed (cudaGetLastError after it)
};

template <class G>
int64_t workspace_bytes(int E, int sm_count) {
  auto arguments = G::arguments(E, nullptr, 0, sm_count);
  return static_cast<int64_t>(G::Gemm::get_workspace_size(arguments));
}

// After the argument kernel's launch: check it, then CUTLASS's checks, initialize and run.
template <class G>
int launch_gemm(typename G::Gemm::Arguments const& arguments, void* workspace,
                cudaStream_t stream) {
  if (cudaGetLastError() != cudaSuccess) return kLaunchFailed;
  typename G::Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return kCannotImplement;
  if (gemm.initialize(arguments, workspace, stream) != cutlass::Status::kSuccess)
    return kInitFailed;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return kLaunchFailed;
  if (cudaGetLastError() != cudaSuccess) return kLaunchFailed;
  return kOk;
}

template <class G>
int run(int E, int N, int K, const int32_t* offsets, const int64_t* a_addr, const void* w,
        const int64_t* out_addr, void* args, void* workspace, int64_t workspace_size,
        int device, int sm_count, cudaStream_t stream) {
  if (E < 1 || N % kAlignment != 0 || K % kAlignment != 0) return kBadShape;
  auto arguments = G::arguments(E, static_cast<char*>(args), device, sm_count);
  if (static_cast<int64_t>(G::Gemm::get_workspace_size(arguments)) > workspace_size)
    return kWorkspaceSmall;
  fill_group_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      E, N, K, offsets, a_addr, static_cast<Element const*>(w), out_addr,
      static_cast<char*>(args));
  return launch_gemm<G>(arguments, workspace, stream);
}

// out[e] = a_e^T @ b_e; zeros: device bf16 [kZeroRows * max(M, N)], all zero.
template <class G>
int run_wgrad(int E, int M, int N, const int32_t* offsets, const int64_t* a_addr,
              const int64_t* b_addr, void* out, const void* zeros, void* args, void* workspace,
              int64_t workspace_size, int device, int sm_count, cudaStream_t stream) {
  if (E < 1 || M % kAlignment != 0 || N % kAlignment != 0) return kBadShape;
  auto arguments = G::arguments(E, static_cast<char*>(args), device, sm_count);
  if (static_cast<int64_t>(G::Gemm::get_workspace_size(arguments)) > workspace_size)
    return kWorkspaceSmall;
  fill_wgrad_args<G><<<(E + 127) / 128, 128, 0, stream>>>(
      E, M, N, offsets, a_addr, b_addr, static_cast<typename G::ElementD*>(out),
      static_cast<Element const*>(zeros), static_cast<char*>(args));
  return launch_gemm<G>(arguments, workspace, stream);
}

}  // namespace dm_sm90

// extern "C" entry points of one tile configuration, named dm_sm90_fprop_<name>_*.
#define DM_SM90_FPROP_ENTRY_POINTS(name, G)                                                     \
  extern "C" int64_t dm_sm90_fprop_##name##_args_bytes(int E) {                                 \
    return static_cast<int64_t>(G::Layout(E).bytes);                                            \
  }                                                                                             \
  extern "C" int64_t dm_sm90_fprop_##name##_workspace_bytes(int E, int sm_count) {              \
    return dm_sm90::workspace_bytes<G>(E, sm_count);                                            \
  }                                                                                             \
  extern "C" int dm_sm90_fprop_##name##_run(                                                    \
      int E, int N, int K, const int32_t* offsets, const int64_t* a_addr, const void* w,        \
      const int64_t* out_addr, void* args, void* workspace, int64_t workspace_size, int device, \
      int sm_count, void* stream) {                                                             \
    return dm_sm90::run<G>(E, N, K, offsets, a_addr, w, out_addr, args, workspace,              \
                           workspace_size, device, sm_count,                                    \
                           static_cast<cudaStream_t>(stream));                                  \
  }


// extern "C" entry points of one WGRAD configuration, named dm_sm90_wgrad_<name>_*.
#define DM_SM90_WGRAD_ENTRY_POINTS(name, G)                                                     \
  extern "C" int64_t dm_sm90_wgrad_##name##_args_bytes(int E) {                                 \
    return static_cast<int64_t>(G::Layout(E).bytes);                                            \
  }                                                                                             \
  extern "C" int64_t dm_sm90_wgrad_##name##_workspace_bytes(int E, int sm_count) {              \
    return dm_sm90::workspace_bytes<G>(E, sm_count);                                            \
  }                                                                                             \
  extern "C" int dm_sm90_wgrad_##name##_run(                                                    \
      int E, int M, int N, const int32_t* offsets, const int64_t* a_addr,                       \
      const int64_t* b_addr, void* out, const void* zeros, void* args, void* workspace,         \
      int64_t workspace_size, int device, int sm_count, void* stream) {                         \
    return dm_sm90::run_wgrad<G>(E, M, N, offsets, a_addr, b_addr, out, zeros, args, workspace, \
                                 workspace_size, device, sm_count,                              \
                                 static_cast<cudaStream_t>(stream));                            \
  }
