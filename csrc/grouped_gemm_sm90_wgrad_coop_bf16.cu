// WGRAD configuration "coop_bf16": bf16 weight gradients, 128x256x64 tiles, 2x1 clusters, two
// consumer warpgroups cooperating on each tile.
#include "grouped_gemm_sm90.cuh"

using DmWgrad = dm_sm90::WgradGemm<
    cutlass::bfloat16_t, cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

DM_SM90_WGRAD_ENTRY_POINTS(coop_bf16, DmWgrad)
