// The LSTM cell's elementwise update (Xu et al. 2015, Eqs. 1-3; nn.LSTMCell's gate order i, f,
// g, o), forward and backward, each in one pass over the step's rows: captioning/models/native/
// __init__.py builds this file with attention.cpp and says why.
//
// From the gates' pre-activations (b, 4H) and c_{t-1} (b, H), in float32:
//   forward   i, f, o = σ(.), g = tanh(.), c_t = f c_{t-1} + i g, h_t = o tanh(c_t)
//             and the activations [i, f, g, o, tanh(c_t)] (b, 5H), kept for the backward
//   backward  dc = dc_t + dh o (1 - tanh²(c_t)),  do = dh tanh(c_t) o (1 - o),
//             di = dc g i (1 - i),  dg = dc i (1 - g²),  df = dc c_{t-1} f (1 - f),
//             dc_{t-1} = dc f
// σ and tanh are ATen's own vector functions (Sleef's, within 1 ulp), and std:: ones in a
// row's tail. Where autograd runs these as some twenty operations a step, each a pass over
// the rows and a node of the graph, this is one operation each way.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 8;  // rows per task: a step's few rows are cheap

inline Vec sigmoid(const Vec& x) { return (Vec(1.f) + x.neg().exp()).reciprocal(); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline Vec tanh_(const Vec& x) { return x.tanh(); }
inline float tanh_(float x) { return std::tanh(x); }
// a vector of floats (a row's body) or one float (its tail)
template <typename V> V load(const float* p);
template <> inline Vec load<Vec>(const float* p) { return Vec::loadu(p); }
template <> inline float load<float>(const float* p) { return *p; }
inline void store(const Vec& v, float* p) { v.store(p); }
inline void store(float v, float* p) { *p = v; }

// One row: gates G (4H), c_{t-1} C (H) -> h, c_t, activations A (5H).
template <typename V>
inline void forward_at(const float* G, const float* C, float* h, float* c, float* A, int64_t H,
                       int64_t a) {
  const V i = sigmoid(load<V>(G + a)), f = sigmoid(load<V>(G + H + a));
  const V g = tanh_(load<V>(G + 2 * H + a)), o = sigmoid(load<V>(G + 3 * H + a));
  const V cn = f * load<V>(C + a) + i * g;
  const V tc = tanh_(cn);
  store(o * tc, h + a);
  store(cn, c + a);
  store(i, A + a);
  store(f, A + H + a);
  store(g, A + 2 * H + a);
  store(o, A + 3 * H + a);
  store(tc, A + 4 * H + a);
}

// One row's backward at column a: upstream dh, dc (nullptr: zero), activations A (5H),
// c_{t-1} C -> dgates D (4H), dc_{t-1} E.
template <typename V>
inline void backward_at(const float* dh, const float* dc, const float* A, const float* C,
                        float* D, float* E, int64_t H, int64_t a) {
  const V one(1.f), zero(0.f);
  const V i = load<V>(A + a), f = load<V>(A + H + a), g = load<V>(A + 2 * H + a);
  const V o = load<V>(A + 3 * H + a), tc = load<V>(A + 4 * H + a);
  const V up_h = dh ? load<V>(dh + a) : zero;
  const V d = (dc ? load<V>(dc + a) : zero) + up_h * o * (one - tc * tc);
  store(d * g * i * (one - i), D + a);
  store(d * load<V>(C + a) * f * (one - f), D + H + a);
  store(d * i * (one - g * g), D + 2 * H + a);
  store(up_h * tc * o * (one - o), D + 3 * H + a);
  store(d * f, E + a);
}

void check_cell(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
              name, " must be a contiguous float32 CPU tensor of shape (", rows, ", ", cols,
              "), got ", t.sizes());
}

// (b, H) of c_{t-1}, checked to be a 2-d tensor first
std::pair<int64_t, int64_t> cell_shape(const at::Tensor& c) {
  TORCH_CHECK(c.dim() == 2, "c must be (b, H), got ", c.sizes());
  return {c.size(0), c.size(1)};
}

}  // namespace

namespace captioning_native {

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(const at::Tensor& gates,
                                                          const at::Tensor& c) {
  const auto [b, H] = cell_shape(c);
  check_cell(c, b, H, "c");
  check_cell(gates, b, 4 * H, "gates");
  at::Tensor h = at::empty({b, H}, c.options()), cn = at::empty({b, H}, c.options()),
             acts = at::empty({b, 5 * H}, c.options());
  const float *G = gates.const_data_ptr<float>(), *C = c.const_data_ptr<float>();
  float *hp = h.mutable_data_ptr<float>(), *cp = cn.mutable_data_ptr<float>(),
        *A = acts.mutable_data_ptr<float>();
  const int64_t body = H - H % Vec::size();
  at::parallel_for(0, b, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = G + r * 4 * H, *cr = C + r * H;
      float *hr = hp + r * H, *cr_new = cp + r * H, *ar = A + r * 5 * H;
      for (int64_t a = 0; a < body; a += Vec::size()) {
        forward_at<Vec>(g, cr, hr, cr_new, ar, H, a);
      }
      for (int64_t a = body; a < H; ++a) {
        forward_at<float>(g, cr, hr, cr_new, ar, H, a);
      }
    }
  });
  return {h, cn, acts};
}

std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const std::optional<at::Tensor>& dh,
                                                      const std::optional<at::Tensor>& dc,
                                                      const at::Tensor& acts,
                                                      const at::Tensor& c) {
  const auto [b, H] = cell_shape(c);
  check_cell(c, b, H, "c");
  check_cell(acts, b, 5 * H, "acts");
  const bool has_h = dh.has_value() && dh->defined(), has_c = dc.has_value() && dc->defined();
  const at::Tensor dhc = has_h ? dh->contiguous() : at::Tensor(),
                   dcc = has_c ? dc->contiguous() : at::Tensor();
  if (has_h) check_cell(dhc, b, H, "dh");
  if (has_c) check_cell(dcc, b, H, "dc");
  at::Tensor dgates = at::empty({b, 4 * H}, c.options()), dprev = at::empty({b, H}, c.options());
  const float *A = acts.const_data_ptr<float>(), *C = c.const_data_ptr<float>();
  const float *DH = has_h ? dhc.const_data_ptr<float>() : nullptr,
              *DC = has_c ? dcc.const_data_ptr<float>() : nullptr;
  float *D = dgates.mutable_data_ptr<float>(), *E = dprev.mutable_data_ptr<float>();
  const int64_t body = H - H % Vec::size();
  at::parallel_for(0, b, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* dhr = DH ? DH + r * H : nullptr;
      const float* dcr = DC ? DC + r * H : nullptr;
      const float *ar = A + r * 5 * H, *cr = C + r * H;
      float *dr = D + r * 4 * H, *er = E + r * H;
      for (int64_t a = 0; a < body; a += Vec::size()) {
        backward_at<Vec>(dhr, dcr, ar, cr, dr, er, H, a);
      }
      for (int64_t a = body; a < H; ++a) {
        backward_at<float>(dhr, dcr, ar, cr, dr, er, H, a);
      }
    }
  });
  return {dgates, dprev};
}

}  // namespace captioning_native

TORCH_LIBRARY_FRAGMENT(captioning_native, m) {
  m.def("lstm_cell(Tensor gates, Tensor c) -> (Tensor, Tensor, Tensor)");
  m.def("lstm_cell_backward(Tensor? dh, Tensor? dc, Tensor acts, Tensor c) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(captioning_native, CPU, m) {
  m.impl("lstm_cell", &captioning_native::lstm_cell);
  m.impl("lstm_cell_backward", &captioning_native::lstm_cell_backward);
}
