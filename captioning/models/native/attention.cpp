// Attention's two per-word operations over the annotation grid, forward and backward, each in
// one pass: captioning/models/native/__init__.py builds this file and says why.
//
// Captions read the grid through `rows`: caption c reads row rows[c] of keys (N, L, A) and
// values (N, L, D); without `rows`, caption c reads row c. Captions of one image share one row
// (a batch of five captions an image, or one image's samples), so each row is read once for all
// of its captions, from cache, however many there are.
//
// The additive score e = w^T tanh(k + q) (Xu et al. 2015, Eq. 4), q (b, A), w (A), keys in
// float32 or bfloat16, arithmetic in float32, t = tanh(k + q) by a rational function
// (`tanh_rational`):
//   forward   e_cl = sum_a w_a t_cla
//   backward  u_cla = g_cl (1 - t_cla^2) w_a
//             dkeys[rows[c], l] += u_cl  (added into the pass's running sum),
//             dq_c = sum_l u_cl,  dw = sum_cl g_cl t_cl
// t is recomputed in the backward instead of stored: one read of the keys costs less than a
// write and a read of a (b, L, A) tensor.
//
// The context z_c = sum_l w_cl v[rows[c], l] (Eq. 6), weights (b, L) in float32, values in
// float32 or bfloat16 (z in their dtype) or float16 (z in float32: a cached grid, read as the
// float32 it holds), and its backward dw_cl = dz_c . v[rows[c], l] (no gradient of the values).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 2 * Vec::size();  // floats per step: one Vectorized<BFloat16>
constexpr int64_t kGrain = 16;               // grid rows (row, l) per task
constexpr int64_t kCols = 256;               // value columns per context task

// 2 * Vec::size() values of T as two float vectors, and back
inline void load2(const float* p, Vec& lo, Vec& hi) {
  lo = Vec::loadu(p);
  hi = Vec::loadu(p + Vec::size());
}
inline void load2(const at::BFloat16* p, Vec& lo, Vec& hi) {
  at::vec::load_to_float<at::BFloat16>(p, lo, hi);
}
inline void load2(const at::Half* p, Vec& lo, Vec& hi) {
  at::vec::load_to_float<at::Half>(p, lo, hi);
}
inline void store2(float* p, const Vec& lo, const Vec& hi) {
  lo.store(p);
  hi.store(p + Vec::size());
}
inline void store2(at::BFloat16* p, const Vec& lo, const Vec& hi) {
  at::vec::convert_from_float<at::BFloat16>(lo, hi).store(p);
}

// tanh by the 13/6-degree rational minimax function that Eigen's float tanh uses, within a
// few ulp: 13 vector operations and one division, where 1 - 2 / (1 + exp(2x)) by ATen's fastest
// exp (exp_u20) takes about 20 and a division. The argument is clamped to ±7.99881172, where
// the function (with FMAs) reaches exactly ±1, so that 1 - t² is never negative; tanh itself is
// within 4 ulp of ±1 beyond. The clamp keeps NaN: a NaN key gives a NaN score.
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return at::vec::fmadd(a, b, c); }
inline float fmadd(float a, float b, float c) { return std::fma(a, b, c); }
constexpr float kTanhOne = 7.99881172180175781f;
inline Vec clamp_tanh(const Vec& x) { return at::vec::clamp(x, Vec(-kTanhOne), Vec(kTanhOne)); }
inline float clamp_tanh(float x) {
  return std::isnan(x) ? x : std::min(kTanhOne, std::max(-kTanhOne, x));
}

template <typename V>
inline V tanh_rational(const V& a) {
  const V x = clamp_tanh(a), x2 = x * x;
  V p = fmadd(x2, V(-2.76076847742355e-16f), V(2.00018790482477e-13f));  // odd numerator
  p = fmadd(x2, p, V(-8.60467152213735e-11f));
  p = fmadd(x2, p, V(5.12229709037114e-08f));
  p = fmadd(x2, p, V(1.48572235717979e-05f));
  p = fmadd(x2, p, V(6.37261928875436e-04f));
  p = fmadd(x2, p, V(4.89352455891786e-03f));
  V d = fmadd(x2, V(1.19825839466702e-06f), V(1.18534705686654e-04f));  // even denominator
  d = fmadd(x2, d, V(2.26843463243900e-03f));
  d = fmadd(x2, d, V(4.89352518554385e-03f));
  return x * p / d;
}

inline float sum_all(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// The captions grouped by the grid row they read: group j reads row[j] and holds the captions
// order[start[j]] .. order[start[j + 1] - 1], in increasing order. Rows no caption reads have
// no group.
struct Groups {
  std::vector<int64_t> order, start, row;
  int64_t largest = 0;
  int64_t size() const { return static_cast<int64_t>(row.size()); }
};

Groups group_by_row(const std::optional<at::Tensor>& rows, int64_t b, int64_t n_rows) {
  std::vector<int64_t> of(b);
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == b && rows->scalar_type() == at::kLong &&
                rows->device().is_cpu(), "rows must be (b,) int64 on the CPU, b = ", b);
    const at::Tensor r = rows->contiguous();
    const int64_t* p = r.const_data_ptr<int64_t>();
    for (int64_t c = 0; c < b; ++c) {
      TORCH_CHECK(p[c] >= 0 && p[c] < n_rows, "rows[", c, "] = ", p[c], " is not a row of ",
                  n_rows);
      of[c] = p[c];
    }
  } else {
    TORCH_CHECK(b <= n_rows, b, " captions read the first rows of only ", n_rows);
    for (int64_t c = 0; c < b; ++c) of[c] = c;
  }
  std::vector<int64_t> count(n_rows, 0), next(n_rows, 0);
  for (int64_t c = 0; c < b; ++c) ++count[of[c]];
  Groups g;
  int64_t offset = 0;
  for (int64_t u = 0; u < n_rows; ++u) {
    if (count[u] == 0) continue;
    g.row.push_back(u);
    g.start.push_back(offset);
    next[u] = offset;
    offset += count[u];
    g.largest = std::max(g.largest, count[u]);
  }
  g.start.push_back(offset);
  g.order.resize(b);
  for (int64_t c = 0; c < b; ++c) g.order[next[of[c]]++] = c;
  return g;
}

// ---- the additive score ---------------------------------------------------------------------

template <typename T>
void score_forward(const T* K, const float* Q, const float* W, T* E,
                   const Groups& G, int64_t L, int64_t A) {
  const int64_t body = A - A % kChunk;
  at::parallel_for(0, G.size() * L, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / L, l = task % L;
      const T* k = K + (G.row[j] * L + l) * A;
      for (int64_t p = G.start[j]; p < G.start[j + 1]; ++p) {
        const int64_t c = G.order[p];
        const float* q = Q + c * A;
        Vec acc(0.f);
        for (int64_t a = 0; a < body; a += kChunk) {
          Vec k0, k1;
          load2(k + a, k0, k1);
          acc = fmadd(Vec::loadu(W + a), tanh_rational(k0 + Vec::loadu(q + a)), acc);
          acc = fmadd(Vec::loadu(W + a + Vec::size()),
                      tanh_rational(k1 + Vec::loadu(q + a + Vec::size())), acc);
        }
        float sum = sum_all(acc);
        for (int64_t a = body; a < A; ++a) {
          sum += W[a] * tanh_rational(static_cast<float>(k[a]) + q[a]);
        }
        E[c * L + l] = static_cast<T>(sum);
      }
    }
  });
}

// one caption's backward on float vectors: u w into dk, dq; g t into dw
inline void score_backward_vec(const Vec& k, const Vec& q, const Vec& w, const Vec& g,
                               Vec& dk, float* dq, float* dw) {
  const Vec t = tanh_rational(k + q);
  const Vec uw = g * fmadd(t, -t, Vec(1.f)) * w;
  dk = dk + uw;
  (Vec::loadu(dq) + uw).store(dq);
  fmadd(g, t, Vec::loadu(dw)).store(dw);
}

// One caption's backward over one grid row k (A values of T) with upstream gradient g: adds
// into that row's gradient dk (the keys' own row, or a float32 sum over the row's captions),
// the caption's dq and the part's dw.
template <typename T, typename D>
void score_backward_row(const T* k, const float* q, const float* W, float g, D* dk, float* dq,
                        float* dw, int64_t A) {
  const int64_t body = A - A % kChunk;
  const Vec gv(g);
  for (int64_t a = 0; a < body; a += kChunk) {
    const int64_t h = a + Vec::size();
    Vec k0, k1, d0, d1;
    load2(k + a, k0, k1);
    load2(dk + a, d0, d1);
    score_backward_vec(k0, Vec::loadu(q + a), Vec::loadu(W + a), gv, d0, dq + a, dw + a);
    score_backward_vec(k1, Vec::loadu(q + h), Vec::loadu(W + h), gv, d1, dq + h, dw + h);
    store2(dk + a, d0, d1);
  }
  for (int64_t a = body; a < A; ++a) {
    const float t = tanh_rational(static_cast<float>(k[a]) + q[a]);
    const float uw = g * fmadd(t, -t, 1.f) * W[a];
    dk[a] = static_cast<D>(static_cast<float>(dk[a]) + uw);
    dq[a] += uw;
    dw[a] = fmadd(g, t, dw[a]);
  }
}

// The grid rows (row, l) of the groups are cut into `parts` fixed ranges, each summing dq and
// dw into its own buffer of `partial` (parts × (b·A + A)): no buffer depends on which thread
// runs a range. A grid row read by several captions sums their gradients in float32 first,
// then adds them into dkeys once; one caption adds straight into it.
template <typename T>
void score_backward(const float* Gup, const T* K, const float* Q, const float* W, T* DK,
                    float* partial, int64_t parts, const Groups& G, int64_t b, int64_t L,
                    int64_t A) {
  const int64_t tasks = G.size() * L, per_part = (tasks + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    std::vector<float> dkf(A);
    for (int64_t part = first; part < last; ++part) {
      float* dq_all = partial + part * (b * A + A);
      float* dw = dq_all + b * A;
      const int64_t end = std::min(tasks, (part + 1) * per_part);
      for (int64_t task = part * per_part; task < end; ++task) {
        const int64_t j = task / L, l = task % L;
        const T* k = K + (G.row[j] * L + l) * A;
        T* dk = DK + (G.row[j] * L + l) * A;
        const int64_t* captions = G.order.data() + G.start[j];
        const int64_t count = G.start[j + 1] - G.start[j];
        if (count == 1) {
          const int64_t c = captions[0];
          score_backward_row(k, Q + c * A, W, Gup[c * L + l], dk, dq_all + c * A, dw, A);
          continue;
        }
        for (int64_t a = 0; a < A; ++a) dkf[a] = static_cast<float>(dk[a]);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t c = captions[i];
          score_backward_row(k, Q + c * A, W, Gup[c * L + l], dkf.data(), dq_all + c * A, dw,
                             A);
        }
        for (int64_t a = 0; a < A; ++a) dk[a] = static_cast<T>(dkf[a]);
      }
    }
  });
}

// ---- the context ----------------------------------------------------------------------------

// z's element type for values of type T: float16 values give float32
template <typename T>
using ContextOut = std::conditional_t<std::is_same_v<T, at::Half>, float, T>;

// Each task: one group and kCols columns of the values, summed over the grid for every caption
// of the group in float32.
template <typename T>
void context_forward(const float* Wt, const T* V, ContextOut<T>* Z, const Groups& G, int64_t L,
                     int64_t D) {
  const int64_t chunks = (D + kCols - 1) / kCols;
  at::parallel_for(0, G.size() * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G.largest * kCols);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / chunks, d0 = (task % chunks) * kCols;
      const int64_t n = std::min(kCols, D - d0), body = n - n % kChunk;
      const int64_t first = G.start[j], count = G.start[j + 1] - first;
      std::fill(acc.begin(), acc.begin() + count * kCols, 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* v = V + (G.row[j] * L + l) * D + d0;
        for (int64_t i = 0; i < count; ++i) {
          const float w = Wt[G.order[first + i] * L + l];
          const Vec wv(w);
          float* z = acc.data() + i * kCols;
          for (int64_t d = 0; d < body; d += kChunk) {
            Vec v0, v1;
            load2(v + d, v0, v1);
            at::vec::fmadd(wv, v0, Vec::loadu(z + d)).store(z + d);
            at::vec::fmadd(wv, v1, Vec::loadu(z + d + Vec::size())).store(z + d + Vec::size());
          }
          // std::fma: every element type rounds alike (a * b + c contracts for some only)
          for (int64_t d = body; d < n; ++d) z[d] = std::fma(w, static_cast<float>(v[d]), z[d]);
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        const float* z = acc.data() + i * kCols;
        ContextOut<T>* out = Z + G.order[first + i] * D + d0;
        int64_t d = 0;
        for (; d < body; d += kChunk) {
          store2(out + d, Vec::loadu(z + d), Vec::loadu(z + d + Vec::size()));
        }
        for (; d < n; ++d) out[d] = static_cast<ContextOut<T>>(z[d]);
      }
    }
  });
}

template <typename T>
void context_backward(const float* DZ, const T* V, float* DW, const Groups& G, int64_t L,
                      int64_t D) {
  const int64_t body = D - D % kChunk;
  at::parallel_for(0, G.size() * L, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / L, l = task % L;
      const T* v = V + (G.row[j] * L + l) * D;
      for (int64_t p = G.start[j]; p < G.start[j + 1]; ++p) {
        const int64_t c = G.order[p];
        const float* dz = DZ + c * D;
        Vec acc0(0.f), acc1(0.f);
        for (int64_t d = 0; d < body; d += kChunk) {
          Vec v0, v1;
          load2(v + d, v0, v1);
          acc0 = at::vec::fmadd(Vec::loadu(dz + d), v0, acc0);
          acc1 = at::vec::fmadd(Vec::loadu(dz + d + Vec::size()), v1, acc1);
        }
        float sum = sum_all(acc0 + acc1);
        for (int64_t d = body; d < D; ++d) sum = std::fma(dz[d], static_cast<float>(v[d]), sum);
        DW[c * L + l] = sum;
      }
    }
  });
}

// ---- checks and entry points ----------------------------------------------------------------

// keys: float32 or bfloat16; values (`half`): float16 too
void check_grid(const at::Tensor& grid, const char* name, bool half = false) {
  const auto type = grid.scalar_type();
  TORCH_CHECK(grid.dim() == 3, name, " must be (N, L, width)");
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || (half && type == at::kHalf), name,
              half ? " must be float32, bfloat16 or float16" : " must be float32 or bfloat16");
  TORCH_CHECK(grid.is_contiguous(), name, " must be contiguous");
}

void check_score(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w) {
  check_grid(keys, "keys");
  TORCH_CHECK(q.dim() == 2 && w.dim() == 1, "q (b, A), w (A)");
  TORCH_CHECK(q.size(1) == keys.size(2) && w.size(0) == keys.size(2),
              "shapes do not match: keys ", keys.sizes(), ", q ", q.sizes(), ", w ", w.sizes());
}

// f(T{}) with T the grid's element type: float or at::BFloat16, and at::Half where `kHalf`
template <bool kHalf = false, typename F>
void dispatch(const at::Tensor& grid, F f) {
  if (grid.scalar_type() == at::kFloat) return f(float{});
  if constexpr (kHalf) {
    if (grid.scalar_type() == at::kHalf) return f(at::Half{});
  }
  f(at::BFloat16{});
}

at::Tensor additive_score(const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w,
                          const std::optional<at::Tensor>& rows) {
  check_score(keys, q, w);
  const int64_t b = q.size(0), L = keys.size(1), A = keys.size(2);
  const Groups G = group_by_row(rows, b, keys.size(0));
  const at::Tensor qf = q.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  at::Tensor e = at::empty({b, L}, keys.options());
  dispatch(keys, [&](auto zero) {
    using T = decltype(zero);
    score_forward<T>(keys.const_data_ptr<T>(), qf.const_data_ptr<float>(),
                     wf.const_data_ptr<float>(), e.mutable_data_ptr<T>(), G, L, A);
  });
  return e;
}

std::tuple<at::Tensor, at::Tensor> additive_score_backward(
    const at::Tensor& g, const at::Tensor& keys, const at::Tensor& q, const at::Tensor& w,
    const std::optional<at::Tensor>& rows, at::Tensor& dkeys) {
  check_score(keys, q, w);
  TORCH_CHECK(dkeys.sizes() == keys.sizes() && dkeys.scalar_type() == keys.scalar_type() &&
              dkeys.is_contiguous(), "dkeys must be contiguous, of the keys' shape and dtype");
  const int64_t b = q.size(0), L = keys.size(1), A = keys.size(2);
  TORCH_CHECK(g.dim() == 2 && g.size(0) == b && g.size(1) == L, "g must be (b, L)");
  const Groups G = group_by_row(rows, b, keys.size(0));
  const at::Tensor gf = g.to(at::kFloat).contiguous(), qf = q.to(at::kFloat).contiguous(),
                   wf = w.to(at::kFloat).contiguous();
  // one range per thread, fewer where there are few grid rows (each at least kGrain of them)
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), G.size() * L / kGrain));
  std::vector<float> partial(parts * (b * A + A), 0.f);
  dispatch(keys, [&](auto zero) {
    using T = decltype(zero);
    score_backward<T>(gf.const_data_ptr<float>(), keys.const_data_ptr<T>(),
                      qf.const_data_ptr<float>(), wf.const_data_ptr<float>(),
                      dkeys.mutable_data_ptr<T>(), partial.data(), parts, G, b, L, A);
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

void check_context(const at::Tensor& per_caption, const at::Tensor& values, int64_t width) {
  check_grid(values, "values", /*half=*/true);
  TORCH_CHECK(per_caption.dim() == 2 && per_caption.size(1) == width,
              "shapes do not match: ", per_caption.sizes(), " against values ", values.sizes());
}

at::Tensor attention_context(const at::Tensor& weights, const at::Tensor& values,
                             const std::optional<at::Tensor>& rows) {
  check_context(weights, values, values.size(1));
  const int64_t b = weights.size(0), L = values.size(1), D = values.size(2);
  const Groups G = group_by_row(rows, b, values.size(0));
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  at::Tensor z;
  dispatch<true>(values, [&](auto zero) {
    using T = decltype(zero);
    using Out = ContextOut<T>;  // float32 for a float16 grid
    z = at::empty({b, D}, values.options().dtype(c10::CppTypeToScalarType<Out>::value));
    context_forward<T>(wf.const_data_ptr<float>(), values.const_data_ptr<T>(),
                       z.mutable_data_ptr<ContextOut<T>>(), G, L, D);
  });
  return z;
}

at::Tensor attention_context_backward(const at::Tensor& dz, const at::Tensor& values,
                                      const std::optional<at::Tensor>& rows) {
  check_context(dz, values, values.size(2));
  const int64_t b = dz.size(0), L = values.size(1), D = values.size(2);
  const Groups G = group_by_row(rows, b, values.size(0));
  const at::Tensor dzf = dz.to(at::kFloat).contiguous();
  at::Tensor dw = at::empty({b, L}, dzf.options());
  dispatch<true>(values, [&](auto zero) {
    using T = decltype(zero);
    context_backward<T>(dzf.const_data_ptr<float>(), values.const_data_ptr<T>(),
                        dw.mutable_data_ptr<float>(), G, L, D);
  });
  return dw;
}

}  // namespace

TORCH_LIBRARY(captioning_native, m) {
  m.def("additive_score(Tensor keys, Tensor q, Tensor w, Tensor? rows) -> Tensor");
  m.def("additive_score_backward(Tensor g, Tensor keys, Tensor q, Tensor w, Tensor? rows, "
        "Tensor(a!) dkeys) -> (Tensor, Tensor)");
  m.def("attention_context(Tensor weights, Tensor values, Tensor? rows) -> Tensor");
  m.def("attention_context_backward(Tensor dz, Tensor values, Tensor? rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(captioning_native, CPU, m) {
  m.impl("additive_score", &additive_score);
  m.impl("additive_score_backward", &additive_score_backward);
  m.impl("attention_context", &attention_context);
  m.impl("attention_context_backward", &attention_context_backward);
}
