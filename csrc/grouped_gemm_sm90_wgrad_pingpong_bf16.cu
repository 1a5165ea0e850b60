// WGRAD configuration "pingpong_bf16": bf16 weight gradients, 64x256x64 tiles, 2x1 clusters; the
// two consumer warpgroups take alternate tiles, so one's epilogue overlaps the other's main loop.
#include "grouped_gemm_sm90.cuh"

using DmWgrad = dm_sm90::WgradGemm<
    cutlass::bfloat16_t, cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

DM_SM90_WGRAD_ENTRY_POINTS(pingpong_bf16, DmWgrad)
