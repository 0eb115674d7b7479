// The additive score e = w^T tanh(k + q) (Xu et al. 2015, Eq. 4), forward and backward, each
// in one pass over the keys: captioning/models/native/__init__.py builds this file and says why.
//
// keys (N, L, A) in float32 or bfloat16; q (b, A), b <= N, scores the first b rows of the keys;
// w (A) in float32. Arithmetic is float32 throughout. tanh is taken as 2 s - 1 with
// s = sigmoid(2 (k + q)), as AdditiveScore does:
//   forward   e_bl = 2 sum_a w_a s_bla - sum_a w_a
//   backward  u_bla = g_bl (1 - t_bla^2) w_a = 4 g_bl s (1 - s) w_a
//             dkeys_bl += u_bl  (or =, `accumulate` false),  dq_b = sum_l u_bl,
//             dw = sum_bl g_bl t_bl
// s is recomputed in the backward instead of stored: one read of the keys costs less than a
// write and a read of a (b, L, A) tensor.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 2 * Vec::size();  // floats per step: one Vectorized<BFloat16>
constexpr int64_t kGrain = 16;               // rows (b, l) per task

// 2 * Vec::size() values of T as two float vectors, and back
inline void load2(const float* p, Vec& lo, Vec& hi) {
  lo = Vec::loadu(p);
  hi = Vec::loadu(p + Vec::size());
}
inline void load2(const at::BFloat16* p, Vec& lo, Vec& hi) {
  at::vec::load_to_float<at::BFloat16>(p, lo, hi);
}
inline void store2(float* p, const Vec& lo, const Vec& hi) {
  lo.store(p);
  hi.store(p + Vec::size());
}
inline void store2(at::BFloat16* p, const Vec& lo, const Vec& hi) {
  at::vec::convert_from_float<at::BFloat16>(lo, hi).store(p);
}

inline Vec sigmoid2(const Vec& x) {  // sigmoid(2x)
  return Vec(1.f) / (Vec(1.f) + (x * Vec(-2.f)).exp());
}
inline float sigmoid2(float x) { return 1.f / (1.f + std::exp(-2.f * x)); }

inline float sum_all(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

template <typename T>
void forward_rows(const T* K, const float* Q, const float* W, float w_sum, T* E, int64_t rows,
                  int64_t L, int64_t A) {
  const int64_t body = A - A % kChunk;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* k = K + r * A;
      const float* q = Q + (r / L) * A;
      Vec acc(0.f);
      for (int64_t a = 0; a < body; a += kChunk) {
        Vec k0, k1;
        load2(k + a, k0, k1);
        acc = at::vec::fmadd(Vec::loadu(W + a), sigmoid2(k0 + Vec::loadu(q + a)), acc);
        acc = at::vec::fmadd(Vec::loadu(W + a + Vec::size()),
                             sigmoid2(k1 + Vec::loadu(q + a + Vec::size())), acc);
      }
      float sum = sum_all(acc);
      for (int64_t a = body; a < A; ++a) sum += W[a] * sigmoid2(static_cast<float>(k[a]) + q[a]);
      E[r] = static_cast<T>(2.f * sum - w_sum);
    }
  });
}

// one row's backward on float vectors: u w into dk, dq; g t into dw
inline void backward_vec(const Vec& k, const Vec& q, const Vec& w, const Vec& g, const Vec& g4,
                         Vec& dk, float* dq, float* dw) {
  const Vec s = sigmoid2(k + q);
  const Vec uw = g4 * s * (Vec(1.f) - s) * w;
  dk = dk + uw;
  (Vec::loadu(dq) + uw).store(dq);
  at::vec::fmadd(g, s + s - Vec(1.f), Vec::loadu(dw)).store(dw);
}

// The rows are cut into `parts` fixed ranges, each summing dq and dw into its own buffer of
// `partial` (parts × (b·A + A)): no buffer depends on which thread runs a range.
template <typename T>
void backward_rows(const float* G, const T* K, const float* Q, const float* W, T* DK,
                   bool accumulate, float* partial, int64_t parts, int64_t b, int64_t L,
                   int64_t A) {
  const int64_t body = A - A % kChunk;
  const int64_t rows = b * L, per_part = (rows + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t part = first; part < last; ++part) {
      float* dq_all = partial + part * (b * A + A);
      float* dw = dq_all + b * A;
      const int64_t end = std::min(rows, (part + 1) * per_part);
      for (int64_t r = part * per_part; r < end; ++r) {
        const int64_t i = r / L;
        const T* k = K + r * A;
        const float* q = Q + i * A;
        T* dk = DK + r * A;
        float* dq = dq_all + i * A;
        const Vec g(G[r]), g4(4.f * G[r]);
        for (int64_t a = 0; a < body; a += kChunk) {
          const int64_t h = a + Vec::size();
          Vec k0, k1, d0(0.f), d1(0.f);
          load2(k + a, k0, k1);
          if (accumulate) load2(dk + a, d0, d1);
          backward_vec(k0, Vec::loadu(q + a), Vec::loadu(W + a), g, g4, d0, dq + a, dw + a);
          backward_vec(k1, Vec::loadu(q + h), Vec::loadu(W + h), g, g4, d1, dq + h, dw + h);
          store2(dk + a, d0, d1);
        }
        for (int64_t a = body; a < A; ++a) {
          const float s = sigmoid2(static_cast<float>(k[a]) + q[a]);
          const float uw = 4.f * G[r] * s * (1.f - s) * W[a];
          dk[a] = static_cast<T>((accumulate ? static_cast<float>(dk[a]) : 0.f) + uw);
          dq[a] += uw;
          dw[a] += G[r] * (2.f * s - 1.f);
        }
      }
    }
  });
}

void check(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w) {
  TORCH_CHECK(keys.dim() == 3 && q.dim() == 2 && w.dim() == 1, "keys (N, L, A), q (b, A), w (A)");
  TORCH_CHECK(q.size(0) <= keys.size(0) && q.size(1) == keys.size(2) && w.size(0) == keys.size(2),
              "shapes do not match: keys ", keys.sizes(), ", q ", q.sizes(), ", w ", w.sizes());
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "keys must be float32 or bfloat16");
  TORCH_CHECK(keys.is_contiguous(), "keys must be contiguous");
}

// f(T{}) with T the keys' element type, float or at::BFloat16
template <typename F>
void dispatch(const at::Tensor& keys, F f) {
  if (keys.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

at::Tensor additive_score(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w) {
  check(keys, q, w);
  const int64_t b = q.size(0), L = keys.size(1), A = keys.size(2);
  const at::Tensor qf = q.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  at::Tensor e = at::empty({b, L}, keys.options());
  const float w_sum = wf.sum().item<float>();
  dispatch(keys, [&](auto zero) {
    using T = decltype(zero);
    forward_rows<T>(keys.const_data_ptr<T>(), qf.const_data_ptr<float>(),
                    wf.const_data_ptr<float>(), w_sum, e.mutable_data_ptr<T>(), b * L, L, A);
  });
  return e;
}

std::tuple<at::Tensor, at::Tensor> additive_score_backward(
    const at::Tensor& g, const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w,
    at::Tensor& dkeys, bool accumulate) {
  check(keys, q, w);
  TORCH_CHECK(dkeys.sizes() == keys.sizes() && dkeys.scalar_type() == keys.scalar_type() &&
              dkeys.is_contiguous(), "dkeys must be contiguous, of the keys' shape and dtype");
  const int64_t b = q.size(0), L = keys.size(1), A = keys.size(2);
  TORCH_CHECK(g.dim() == 2 && g.size(0) == b && g.size(1) == L, "g must be (b, L)");
  const at::Tensor gf = g.to(at::kFloat).contiguous(), qf = q.to(at::kFloat).contiguous(),
                   wf = w.to(at::kFloat).contiguous();
  // one range per thread, fewer where there are few rows (each range at least kGrain rows)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                b * L / kGrain));
  std::vector<float> partial(parts * (b * A + A), 0.f);
  dispatch(keys, [&](auto zero) {
    using T = decltype(zero);
    backward_rows<T>(gf.const_data_ptr<float>(), keys.const_data_ptr<T>(),
                     qf.const_data_ptr<float>(), wf.const_data_ptr<float>(),
                     dkeys.mutable_data_ptr<T>(), accumulate, partial.data(), parts, b, L,
                     A);
  });
  at::Tensor dq = at::zeros({b, A}, qf.options()), dw = at::zeros({A}, wf.options());
  float* dq_p = dq.mutable_data_ptr<float>();
  float* dw_p = dw.mutable_data_ptr<float>();
  for (int64_t t = 0; t < parts; ++t) {
    const float* part = partial.data() + t * (b * A + A);
    for (int64_t j = 0; j < b * A; ++j) dq_p[j] += part[j];
    for (int64_t j = 0; j < A; ++j) dw_p[j] += part[b * A + j];
  }
  return {dq, dw};
}

}  // namespace

TORCH_LIBRARY(captioning_native, m) {
  m.def("additive_score(Tensor keys, Tensor q, Tensor w) -> Tensor");
  m.def("additive_score_backward(Tensor g, Tensor keys, Tensor q, Tensor w, Tensor(a!) dkeys, "
        "bool accumulate) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(captioning_native, CPU, m) {
  m.impl("additive_score", &additive_score);
  m.impl("additive_score_backward", &additive_score_backward);
}
