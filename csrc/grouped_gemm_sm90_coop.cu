// Tile configuration "coop": 128x256x64 tiles, 2x1 clusters (the B tile is multicast to both
// CTAs of a cluster), two consumer warpgroups cooperating on each tile.
#include "grouped_gemm_sm90.cuh"

using DmFpropCoop = dm_sm90::FpropGemm<
    cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

DM_SM90_FPROP_ENTRY_POINTS(coop, DmFpropCoop)
