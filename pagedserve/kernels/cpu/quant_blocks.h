// GGUF weight blocks as quant_linear.cpp decodes them, for the other kernels that read them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedserve {

// Fails (naming the sizes) unless w is contiguous uint8 [N, bytes] holding rows of `cols`
// elements as `qtype` blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
void check_quant_weight(const at::Tensor& w, int64_t qtype, int64_t cols);

// `rows` whole rows of `qtype` blocks at src (back to back) -> float32 [rows, cols] at dst,
// decoded as the matmul decodes them.
void dequantize_rows_float(int64_t qtype, const uint8_t* src, int64_t rows, int64_t cols, float* dst);

}  // namespace pagedserve
