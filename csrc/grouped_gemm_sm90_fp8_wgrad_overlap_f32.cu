// FP8 WGRAD configuration "overlap_f32": fp32 weight gradients, stored or added (source operand
// C = D); 128x128x128 tiles, 1x2 clusters (the A tile is multicast to both CTAs of a cluster),
// two consumer warpgroups cooperating on each tile; each 128-wide K block's promotion
// overlapped with the next block's wgmmas (fp8_promotion_overlap.cuh).
#include "grouped_gemm_sm90_fp8.cuh"

using DmFp8Wgrad = dm_sm90::Fp8WgradGemm<
    float, true,
    cute::Shape<cute::_128, cute::_128, cute::_128>,
    cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

DM_SM90_FP8_WGRAD_ENTRY_POINTS(overlap_f32, DmFp8Wgrad)
