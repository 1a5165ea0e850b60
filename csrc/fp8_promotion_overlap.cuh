// The mainloop of CUTLASS's sm90 ptr-array FP8 blockwise-scaled collective with each 128-wide K
// block's promotion overlapped with the next block's wgmmas.
//
// CUTLASS's collective waits for a block's wgmmas (warpgroup_wait<0>) before it promotes them:
// accum += partial * sa[m] * sb[n] on the FP32 pipe, while the tensor cores idle. With per-row
// scales on both operands (the WGRAD's Sm90BlockwiseScaleConfig<1, 1, 128>) that is an FMUL and
// an FFMA per accumulator per block: at 128 x 128 x 128 the FP32 work of a block is half its MMA
// time, so a warpgroup that does not overlap them reaches at most 2/3 of the MMA rate.
//
// Here each warpgroup keeps two partial-sum fragments: block k's wgmmas write one while block
// k-1's partials (the other) are promoted, so only the MMAs are on the critical path
// (warpgroup_wait<1>). The cost is 64 more registers per thread at 128 x 128 tiles (the main
// accumulator plus two partial fragments: 192), which the consumer warpgroups' 232 hold.
// Block k-1's scales are read from its shared-memory stage, which is released only after its
// promotion (as CUTLASS releases it after the next block's wait), so the stages in flight are
// the same as the base's.
//
// Everything else (TMA loads, tensormap updates, the pipeline, mma_tail) is the base
// collective's: this type only shadows mma(), which the ptr-array kernels call on
// CollectiveMainloop.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"

namespace dm_sm90 {

template <class Base>
struct Fp8PromotionOverlapMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using ElementBlockScale = typename Base::ElementBlockScale;
  static constexpr int ScaleMsPerTile = Base::ScaleMsPerTile;
  static constexpr int ScaleNsPerTile = Base::ScaleNsPerTile;
  // One promotion per k tile: the scale block spans the whole tile along K.
  static_assert(Base::ScaleGranularityK == cute::size<2>(typename Base::TileShape{}),
                "the overlapped promotion expects one scale block per k tile");
  static_assert(ScaleMsPerTile > 1, "per-row A scales expected (the row and column bundles)");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    using SmemLayoutA = typename Base::SmemLayoutA;
    using SmemLayoutB = typename Base::SmemLayoutB;
    using SmemLayoutSFA = typename Base::SmemLayoutSFA;
    using SmemLayoutSFB = typename Base::SmemLayoutSFB;
    using TileShape = typename Base::TileShape;

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // The scales as accumulator-shaped views, broadcast along the other operand's mode
    // (the base's construction).
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), make_layout(
        make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                   make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
        make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                    make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), make_layout(
        make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                   make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
        make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                    make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{},
                                                  Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);   // (MMA,M,N,(K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCsA = thread_mma.partition_A(sA);                            // (MMA,M,K,PIPE)
    Tensor tCsB = thread_mma.partition_B(sB);
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor tCrSFB = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    Tensor part0 = make_fragment_like(accum);   // block k's partial sums ...
    Tensor part1 = make_fragment_like(accum);   // ... and block k-1's, alternating
    clear(accum);
    if (k_tile_count <= 0) {
      return;
    }

    // Block k's wgmmas into `part` from its stage (not waited for).
    auto issue = [&](auto& part, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
    };
    // accum += part * sa * sb with the scales of `stage` (its wgmmas complete).
    auto promote = [&](auto& part, int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      warpgroup_fence_operand(part);
      if constexpr (ScaleNsPerTile == 1) {
        ElementBlockScale scale_b = tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); i++) {
          filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) {
          accum(i) += part(i) * tCrSFA(i);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) {
          accum(i) += part(i) * tCrSFA(i) * tCrSFB(i);
        }
      }
      warpgroup_fence_operand(part);
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, barrier_token);
    issue(part0, smem_pipe_read.index());
    ++smem_pipe_read;

    // Issue block k into `next`, then promote block k-1 from `prev` and release its stage.
    auto step = [&](auto& next, auto& prev) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      issue(next, smem_pipe_read.index());
      warpgroup_wait<1>();
      promote(prev, smem_pipe_release.index());
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      ++smem_pipe_read;
    };

    int remaining = k_tile_count - 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; remaining >= 2; remaining -= 2) {
      step(part1, part0);
      step(part0, part1);
    }
    // The last block's stage stays held: mma_tail releases it.
    if (remaining == 1) {
      step(part1, part0);
      warpgroup_wait<0>();
      promote(part1, smem_pipe_release.index());
    } else {
      warpgroup_wait<0>();
      promote(part0, smem_pipe_release.index());
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace dm_sm90
