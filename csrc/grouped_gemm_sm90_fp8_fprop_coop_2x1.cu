// FP8 FPROP configuration "coop_2x1": as "coop" with 2x1 clusters (the B tile, the weights, is
// multicast to both CTAs of a cluster, which hold two m-tiles of one expert).
#include "grouped_gemm_sm90_fp8.cuh"

using DmFp8Fprop2x1 = dm_sm90::Fp8FpropGemm<
    cute::Shape<cute::_128, cute::_128, cute::_128>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

DM_SM90_FP8_FPROP_ENTRY_POINTS(coop_2x1, DmFp8Fprop2x1)
