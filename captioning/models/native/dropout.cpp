// Dropout masks from torch's CPU generator, drawn as F.dropout draws them, in bulk:
// captioning/models/native/__init__.py builds this file with attention.cpp and says why
// (`dropout_mask`).
//
// F.dropout's CPU mask keeps element i where u_i < 1 - p, u_i = torch.rand's float64 draw: the
// 53 low bits of two 32-bit outputs of the generator's Mersenne twister (ATen's mt19937, the
// first output the high word), times 2^-53; a kept element is 1 / (1 - p) in float32, a
// dropped one 0. ATen draws them one call of the engine at a time; here the engine's state is
// copied out, regenerated and tempered 624 words at a time in loops the compiler vectorises,
// and put back advanced exactly as those calls would leave it.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>

namespace captioning_native {

constexpr int kStateN = 624, kStateM = 397;  // at::mt19937's MERSENNE_STATE_N and _M
constexpr uint32_t kMatrixA = 0x9908b0df, kUpper = 0x80000000, kLower = 0x7fffffff;

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & kUpper) | (v & kLower)) >> 1) ^ ((v & 1) ? kMatrixA : 0);
}

// at::mt19937's next_state: the same recurrence, in two loops without a carried dependence
// (the second reads words the first has written, 227 back)
void next_state(uint32_t* s) {
  for (int i = 0; i < kStateN - kStateM; ++i) s[i] = s[i + kStateM] ^ twist(s[i], s[i + 1]);
  for (int i = kStateN - kStateM; i < kStateN - 1; ++i) {
    s[i] = s[i + kStateM - kStateN] ^ twist(s[i], s[i + 1]);
  }
  s[kStateN - 1] = s[kStateM - 1] ^ twist(s[kStateN - 1], s[0]);
}

inline uint32_t temper(uint32_t y) {
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680;
  y ^= (y << 15) & 0xefc60000;
  y ^= (y >> 18);
  return y;
}

// The next `count` outputs of the engine whose data is `d`, advancing `d` as `count` calls of
// at::mt19937's operator() would: a call first decrements left_, regenerates the state where
// it reaches 0 (left_ = 624, next_ = 0), then tempers state_[next_++].
void draw(at::mt19937_data_pod& d, uint32_t* out, int64_t count) {
  while (count > 0) {
    int64_t ready = d.left_ - 1;  // words the state holds before the next regeneration
    if (ready == 0) {
      next_state(d.state_.data());
      d.left_ = kStateN + 1;  // the next call's decrement leaves 624, as after next_state
      d.next_ = 0;
      ready = kStateN;
    }
    const int64_t take = std::min(ready, count);
    const uint32_t* s = d.state_.data() + d.next_;
    for (int64_t i = 0; i < take; ++i) out[i] = temper(s[i]);
    out += take;
    d.next_ += static_cast<uint32_t>(take);
    d.left_ -= static_cast<int>(take);
    count -= take;
  }
}

at::Tensor dropout_mask(at::IntArrayRef shape, double keep,
                        const std::optional<at::Generator>& generator) {
  TORCH_CHECK(keep > 0 && keep < 1, "keep must be in (0, 1), got ", keep);
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  float* out = mask.mutable_data_ptr<float>();
  const int64_t n = mask.numel();
  const float kept = 1.0f / static_cast<float>(keep);
  // u = k 2^-53 < keep, k an integer below 2^53, exactly where k < ceil(keep 2^53)
  const uint64_t below = static_cast<uint64_t>(std::ceil(std::ldexp(keep, 53)));
  constexpr uint64_t kLow53 = (uint64_t{1} << 53) - 1;
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      generator, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::mt19937_data_pod d = gen->engine().data();
  constexpr int64_t kBlock = 2048;  // elements a block, two words each
  uint32_t words[2 * kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = std::min(kBlock, n - start);
    draw(d, words, 2 * m);
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t k = ((static_cast<uint64_t>(words[2 * i]) << 32) | words[2 * i + 1]) & kLow53;
      out[start + i] = k < below ? kept : 0.f;
    }
  }
  at::mt19937 engine;
  engine.set_data(d);
  gen->set_engine(engine);
  return mask;
}

}  // namespace captioning_native

TORCH_LIBRARY_FRAGMENT(captioning_native, m) {
  // no tensor argument to dispatch on: one kernel for every dispatch key (it makes a CPU tensor)
  m.def("dropout_mask(int[] shape, float keep, Generator? generator=None) -> Tensor",
        &captioning_native::dropout_mask);
}
