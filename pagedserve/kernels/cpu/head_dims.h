// The head dims the attention kernels compile in, and the dispatch from a runtime size to them.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace pagedserve {

// fn(std::integral_constant<int, D>{}) for head dim d, or an error naming the compiled ones; the
// list is CpuKernelAttentionBackend.HEAD_DIMS on the Python side (worker/attention.py).
template <typename F>
void with_head_dim(int64_t d, F&& fn) {
  switch (d) {
    case 32: fn(std::integral_constant<int, 32>{}); break;
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 80: fn(std::integral_constant<int, 80>{}); break;
    case 96: fn(std::integral_constant<int, 96>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    case 256: fn(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "head_dim ", d, " not compiled in (32, 64, 80, 96, 128, 256)");
  }
}

}  // namespace pagedserve
