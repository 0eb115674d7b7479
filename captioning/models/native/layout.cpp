// A float32 matrix copied transposed: captioning/models/native/__init__.py builds this file with
// attention.cpp and says why (`transposed`).
//
// x (R, C) contiguous -> (C, R) contiguous, in 16 × 16 tiles held in vector registers (ATen's
// transpose_mxn; element by element where the build has no such kernel), each thread taking
// its own blocks of 16 rows. ATen's own transposing copy runs on one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>

namespace captioning_native {

constexpr int64_t kTile = 16;  // rows per block: one tile's height

at::Tensor transposed(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "transposed takes a contiguous 2-D float32 tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor y = at::empty({C, R}, x.options());
  const float* src = x.const_data_ptr<float>();
  float* dst = y.mutable_data_ptr<float>();
  const int64_t blocks = (R + kTile - 1) / kTile;
  // about 64 KB of x a task: a block of 16 rows of 512 columns is 32 KB
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, kTile * C));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t r0 = block * kTile, rows = std::min(kTile, R - r0);
      for (int64_t c0 = 0; c0 < C; c0 += kTile) {
        at::vec::transpose_mxn<float>(src + r0 * C + c0, C, dst + c0 * R + r0, R,
                                      static_cast<int>(rows),
                                      static_cast<int>(std::min(kTile, C - c0)));
      }
    }
  });
  return y;
}

}  // namespace captioning_native

TORCH_LIBRARY_FRAGMENT(captioning_native, m) {
  m.def("transposed(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(captioning_native, CPU, m) {
  m.impl("transposed", &captioning_native::transposed);
}
