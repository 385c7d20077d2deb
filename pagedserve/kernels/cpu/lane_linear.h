// The float32 lane kernel's entry for callers that lay out one 16-column group themselves
// (dequant_lane.cpp: GGUF blocks dequantized a group at a time).
#pragma once

#include <cstdint>

namespace pagedserve {

bool lane_linear_available(bool bfloat16);

// out[i, c] = sum over p < k of x[i, p] * group[16 * p + c], for rows i < m and columns c < valid
// (1..16): `group` is one group of pack_lane_weight's float32 layout (k x 16 floats). Only where
// lane_linear_available(false).
void lane_group_float(int64_t m, const float* x, int64_t ldx, const float* group, int64_t k, float* out, int64_t ldo,
                      int valid);

}  // namespace pagedserve
