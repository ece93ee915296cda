#include "dew/nn/s5.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <string>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/autograd_detail.h"
#include "dew/nn/blocks.h"
#include "dew/nn/fused.h"

namespace dew::nn {

namespace {

// JAX's lecun_normal: a normal truncated to +-2 standard deviations, rescaled so that the variance is
// 1/fan_in; drawn by inverting the normal CDF on the truncated range.
void lecun_normal_(Tensor t, int64_t fan_in) {
  const double lo = 0.5 * std::erfc(2.0 / std::sqrt(2.0));  // Phi(-2)
  const double stddev = std::sqrt(1.0 / static_cast<double>(fan_in)) / 0.87962566103423978;
  t.uniform_(lo, 1.0 - lo);
  t.mul_(2).sub_(1).erfinv_().mul_(std::sqrt(2.0) * stddev);
}

// (re, im) of p^s for p = exp(log_re + i log_im).
std::pair<Tensor, Tensor> power(const Tensor& log_re, const Tensor& log_im, int64_t s) {
  const Tensor mag = at::exp(log_re * static_cast<double>(s)), ang = log_im * static_cast<double>(s);
  return {mag * at::cos(ang), mag * at::sin(ang)};
}

void check_scan_inputs(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b_re, const Tensor& b_im) {
  DEW_CHECK(b_re.dim() == 3 && b_re.sizes() == b_im.sizes(), "s5_scan: b_re and b_im must both be [B, L, N], got ",
            b_re.sizes(), " and ", b_im.sizes());
  DEW_CHECK(log_a_re.dim() == 1 && log_a_re.sizes() == log_a_im.sizes() && log_a_re.size(0) == b_re.size(2),
            "s5_scan: log_a must be [", b_re.size(2), "], got ", log_a_re.sizes(), " and ", log_a_im.sizes());
}

}  // namespace

// ---- scans ----

namespace {

// x_k = a x_{k-1} + b_k step by step as ATen ops, a = (a_re, a_im): [N], b: [B, L, N]; the states stacked
// (re, im) as [2, B, L, N]. The readable recurrence, and the differentiable composite of the fused one.
Tensor recurrence_composite(const Tensor& a_re, const Tensor& a_im, const Tensor& b_re, const Tensor& b_im) {
  Tensor x_re = at::zeros_like(b_re.select(1, 0)), x_im = at::zeros_like(x_re);  // [B, N]
  std::vector<Tensor> re, im;
  const auto br = b_re.unbind(1), bi = b_im.unbind(1);
  for (size_t k = 0; k < br.size(); ++k) {
    Tensor nr = a_re * x_re - a_im * x_im + br[k];
    Tensor ni = a_re * x_im + a_im * x_re + bi[k];
    x_re = nr;
    x_im = ni;
    re.push_back(x_re);
    im.push_back(x_im);
  }
  return at::stack({at::stack(re, 1), at::stack(im, 1)});
}

// The same recurrence as one loop per sequence over float32 CPU tensors, forward and backward, in place of
// the log2(L) rounds of whole-tensor ops of the parallel scan (a dozen ATen ops each, and their backward):
// in hybrid_dit's step those element-wise ops were most of the time. Sequences (the batch) run in parallel;
// a's gradient is summed per sequence in double, then over sequences in order, so every result has the same
// bits at any thread count. Backward: the adjoint h_k = g_k + conj(a) h_{k+1} is b_k's gradient, and a's
// is sum_k h_k conj(x_{k-1}).
struct S5RecurrenceFunction : public torch::autograd::Function<S5RecurrenceFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& a_re, const Tensor& a_im,
                        const Tensor& b_re, const Tensor& b_im) {
    const Tensor ar = a_re.contiguous(), ai = a_im.contiguous(), br = b_re.contiguous(), bi = b_im.contiguous();
    const int64_t B = br.size(0), L = br.size(1), N = br.size(2);
    Tensor x = at::empty({2, B, L, N}, br.options());
    const float *pa_r = ar.data_ptr<float>(), *pa_i = ai.data_ptr<float>();
    const float *pb_r = br.data_ptr<float>(), *pb_i = bi.data_ptr<float>();
    float* px_r = x.data_ptr<float>();
    float* px_i = px_r + B * L * N;
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t o = b * L * N;
        for (int64_t n = 0; n < N; ++n) {
          px_r[o + n] = pb_r[o + n];
          px_i[o + n] = pb_i[o + n];
        }
        for (int64_t k = 1; k < L; ++k) {
          const int64_t c = o + k * N, p = c - N;
          for (int64_t n = 0; n < N; ++n) {
            const float xr = px_r[p + n], xi = px_i[p + n];
            px_r[c + n] = pa_r[n] * xr - pa_i[n] * xi + pb_r[c + n];
            px_i[c + n] = pa_r[n] * xi + pa_i[n] * xr + pb_i[c + n];
          }
        }
      }
    });
    ctx->save_for_backward({a_re, a_im, b_re, b_im, x});
    return x;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph: the composite's differentiable gradients
      const Tensor x = recurrence_composite(saved[0], saved[1], saved[2], saved[3]);
      return detail::composite_grads(x, {saved[0], saved[1], saved[2], saved[3]}, 4, grads[0], 4);
    }
    const Tensor ar = saved[0].contiguous(), ai = saved[1].contiguous(), x = saved[4], g = grads[0].contiguous();
    const int64_t B = x.size(1), L = x.size(2), N = x.size(3);
    Tensor h = at::empty_like(g);                                      // [2, B, L, N]: b's gradient
    Tensor da = at::zeros({B, 2, N}, x.options().dtype(at::kDouble));  // a's, per sequence
    const float *pa_r = ar.data_ptr<float>(), *pa_i = ai.data_ptr<float>();
    const float *px_r = x.data_ptr<float>(), *px_i = px_r + B * L * N;
    const float *pg_r = g.data_ptr<float>(), *pg_i = pg_r + B * L * N;
    float* ph_r = h.data_ptr<float>();
    float* ph_i = ph_r + B * L * N;
    double* pda = da.data_ptr<double>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t o = b * L * N;
        double* da_r = pda + b * 2 * N;
        double* da_i = da_r + N;
        for (int64_t k = L - 1; k >= 0; --k) {
          const int64_t c = o + k * N;
          for (int64_t n = 0; n < N; ++n) {
            float hr = pg_r[c + n], hi = pg_i[c + n];
            if (k + 1 < L) {
              const float nr = ph_r[c + N + n], ni = ph_i[c + N + n];
              hr += pa_r[n] * nr + pa_i[n] * ni;
              hi += pa_r[n] * ni - pa_i[n] * nr;
            }
            ph_r[c + n] = hr;
            ph_i[c + n] = hi;
            if (k > 0) {
              const float xr = px_r[c - N + n], xi = px_i[c - N + n];
              da_r[n] += static_cast<double>(hr) * xr + static_cast<double>(hi) * xi;
              da_i[n] += static_cast<double>(hi) * xr - static_cast<double>(hr) * xi;
            }
          }
        }
      }
    });
    Tensor da_sum = at::zeros({2, N}, da.options());
    for (int64_t b = 0; b < B; ++b) da_sum += da.select(0, b);  // in order: the same bits at any thread count
    const Tensor da_f = da_sum.to(at::kFloat);
    return {da_f.select(0, 0), da_f.select(0, 1), h.select(0, 0), h.select(0, 1)};
  }
};

// (re, im) of a = exp(log_a) in b's dtype.
std::pair<Tensor, Tensor> scan_coefficient(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b) {
  return power(log_a_re.to(b.scalar_type()), log_a_im.to(b.scalar_type()), 1);
}

}  // namespace

std::pair<Tensor, Tensor> s5_scan(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b_re,
                                  const Tensor& b_im) {
  check_scan_inputs(log_a_re, log_a_im, b_re, b_im);
  const int64_t L = b_re.size(1);
  if (fused_kernels_apply(b_re) && fused_kernels_apply(b_im) && b_re.numel() > 0) {
    auto [a_re, a_im] = scan_coefficient(log_a_re, log_a_im, b_re);
    const Tensor x = S5RecurrenceFunction::apply(a_re, a_im, b_re, b_im);
    return {x.select(0, 0), x.select(0, 1)};
  }
  const auto dt = b_re.scalar_type();
  const Tensor lr = log_a_re.to(dt), li = log_a_im.to(dt);
  Tensor x_re = b_re, x_im = b_im;  // [B, L, N]
  // Hillis-Steele: x_k += a^s x_{k-s} for all k >= s at once; the time-invariant a makes the combined
  // coefficient of every pair the same power a^s.
  for (int64_t s = 1; s < L; s *= 2) {
    auto [p_re, p_im] = power(lr, li, s);  // [N]
    const Tensor h_re = x_re.narrow(1, 0, L - s), h_im = x_im.narrow(1, 0, L - s);
    const Tensor n_re = p_re * h_re - p_im * h_im, n_im = p_re * h_im + p_im * h_re;  // [B, L - s, N]
    x_re = x_re + at::constant_pad_nd(n_re, {0, 0, s, 0});
    x_im = x_im + at::constant_pad_nd(n_im, {0, 0, s, 0});
  }
  return {x_re, x_im};
}

std::pair<Tensor, Tensor> s5_scan_reference(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b_re,
                                            const Tensor& b_im) {
  check_scan_inputs(log_a_re, log_a_im, b_re, b_im);
  auto [a_re, a_im] = scan_coefficient(log_a_re, log_a_im, b_re);
  const Tensor x = recurrence_composite(a_re, a_im, b_re, b_im);
  return {x.select(0, 0), x.select(0, 1)};
}

// ---- S5Layer ----

namespace {
void check_s5_options(const S5Options& o) {
  DEW_CHECK(o.dim() > 0, "S5: dim must be > 0, got ", o.dim());
  DEW_CHECK(o.state_dim() > 0, "S5: state_dim must be > 0, got ", o.state_dim());
  DEW_CHECK(o.dt_min() > 0 && o.dt_max() >= o.dt_min(), "S5: need 0 < dt_min <= dt_max, got ", o.dt_min(), " and ",
            o.dt_max());
}
}  // namespace

S5LayerImpl::S5LayerImpl(S5Options options_) : options(std::move(options_)) {
  check_s5_options(options);
  reset();
}

void S5LayerImpl::reset() {
  const int64_t n = options.state_dim(), d = options.dim();
  log_A_real = register_parameter("log_A_real", at::empty({n}));
  A_imag = register_parameter("A_imag", at::empty({n}));
  B_re = register_parameter("B_re", at::empty({n, d}));
  B_im = register_parameter("B_im", at::empty({n, d}));
  C_re = register_parameter("C_re", at::empty({d, n}));
  C_im = register_parameter("C_im", at::empty({d, n}));
  D = register_parameter("D", at::empty({d}));
  log_dt = register_parameter("log_dt", at::empty({n}));
  reset_parameters();
}

void S5LayerImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const int64_t n = options.state_dim(), d = options.dim();
  const Tensor idx = at::arange(n, at::kFloat);
  log_A_real.copy_(at::log(idx + 0.5));  // A_real = -(n + 1/2)
  A_imag.copy_(idx * M_PI);              // A_imag = pi n
  // As the original (flax kernels [in, out]): fan_in is the leading axis, N for B and D for C.
  for (auto* p : {&B_re, &B_im}) lecun_normal_(*p, n);
  for (auto* p : {&C_re, &C_im}) lecun_normal_(*p, d);
  D.normal_(0.0, 1.0);
  log_dt.uniform_(std::log(options.dt_min()), std::log(options.dt_max()));
}

S5Discrete S5LayerImpl::discretize() const {
  const Tensor dt = at::exp(log_dt);                        // [N]
  const Tensor a_re = -at::exp(log_A_real), a_im = A_imag;  // A
  S5Discrete out;
  out.log_a_re = a_re * dt;  // log Abar = A dt
  out.log_a_im = a_im * dt;
  // Abar - 1 = e^x cos y - 1 + i e^x sin y, with e^x cos y - 1 = expm1(x) cos y - 2 sin^2(y/2): no
  // cancellation when A dt is small.
  const Tensor ex = at::exp(out.log_a_re), c = at::cos(out.log_a_im), sh = at::sin(out.log_a_im * 0.5);
  const Tensor m_re = at::expm1(out.log_a_re) * c - 2 * sh * sh, m_im = ex * at::sin(out.log_a_im);
  // q = (Abar - 1) / A = (Abar - 1) conj(A) / |A|^2
  const Tensor a2 = a_re * a_re + a_im * a_im;
  const Tensor q_re = ((m_re * a_re + m_im * a_im) / a2).unsqueeze(1);  // [N, 1]
  const Tensor q_im = ((m_im * a_re - m_re * a_im) / a2).unsqueeze(1);
  out.b_re = q_re * B_re - q_im * B_im;  // Bbar = q B: [N, D]
  out.b_im = q_re * B_im + q_im * B_re;
  return out;
}

Tensor S5LayerImpl::readout(const Tensor& x_re, const Tensor& x_im, const Tensor& u_f32) const {
  // y = Re(C x) + D u = C_re x_re - C_im x_im + D u, one matmul over the stacked (re, im) states.
  const Tensor w = at::cat({C_re, -C_im}, 1);  // [D, 2N]
  return at::addcmul(at::linear(at::cat({x_re, x_im}, -1), w), D, u_f32);
}

Tensor S5LayerImpl::forward(const Tensor& u) {
  DEW_CHECK(u.dim() == 3 && u.size(2) == options.dim(), "S5: u must be [B, L, ", options.dim(), "], got ", u.sizes());
  const S5Discrete z = discretize();
  const Tensor uf = u.to(at::kFloat);
  const int64_t n = options.state_dim();
  const Tensor bu = at::linear(uf, at::cat({z.b_re, z.b_im}, 0));  // [B, L, 2N]: Bbar u_k (re, im)
  auto [x_re, x_im] = s5_scan(z.log_a_re, z.log_a_im, bu.narrow(2, 0, n), bu.narrow(2, n, n));
  return readout(x_re, x_im, uf).to(u.scalar_type());
}

Tensor S5LayerImpl::forward_reference(const Tensor& u) {
  DEW_CHECK(u.dim() == 3 && u.size(2) == options.dim(), "S5: u must be [B, L, ", options.dim(), "], got ", u.sizes());
  const S5Discrete z = discretize();
  const Tensor uf = u.to(at::kFloat);
  const Tensor b_re = at::matmul(uf, z.b_re.t()), b_im = at::matmul(uf, z.b_im.t());
  auto [x_re, x_im] = s5_scan_reference(z.log_a_re, z.log_a_im, b_re, b_im);
  return readout(x_re, x_im, uf).to(u.scalar_type());
}

// ---- S5 ----

S5Impl::S5Impl(S5Options options_) : options(std::move(options_)) {
  check_s5_options(options);
  reset();
}

void S5Impl::reset() {
  s5_forward = register_module("s5_forward", S5Layer(options));
  if (options.bidirectional()) {
    s5_backward = register_module("s5_backward", S5Layer(options));
    out_proj = register_module("out_proj", torch::nn::Linear(2 * options.dim(), options.dim()));
  }
  reset_parameters();
}

void S5Impl::reset_parameters() {
  if (out_proj.is_empty()) return;
  torch::NoGradGuard no_grad;
  lecun_normal_(out_proj->weight, 2 * options.dim());  // flax Dense's default
  out_proj->bias.zero_();
}

Tensor S5Impl::forward(const Tensor& u) {
  if (!options.bidirectional()) return s5_forward(u);
  const Tensor fwd = s5_forward(u);
  const Tensor bwd = s5_backward(u.flip({1})).flip({1});
  return dense(at::cat({fwd, bwd}, -1), out_proj);
}

// ---- SpatialFusion ----

SpatialFusionImpl::SpatialFusionImpl(SpatialFusionOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.dim() > 0, "SpatialFusion: dim must be > 0, got ", options.dim());
  DEW_CHECK(!options.dilations().empty(), "SpatialFusion: dilations must not be empty");
  for (int64_t d : options.dilations()) DEW_CHECK(d > 0, "SpatialFusion: dilations must be > 0, got ", d);
  reset();
}

void SpatialFusionImpl::reset() {
  convs.clear();
  const int64_t c = options.dim();
  for (int64_t d : options.dilations()) {
    auto layer = torch::nn::Conv2d(
        torch::nn::Conv2dOptions(c, c, 3).groups(c).padding(d).dilation(d).bias(false));  // depthwise, "same"
    convs.push_back(register_module("dwconv_dil" + std::to_string(d), layer));
  }
  reset_parameters();
}

void SpatialFusionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto& c : convs) c->weight.zero_();  // the fusion starts as the identity
}

Tensor SpatialFusionImpl::forward(const Tensor& y, int64_t h, int64_t w, const Tensor& perm, const Tensor& inverse) {
  DEW_CHECK(y.dim() == 3 && y.size(1) == h * w && y.size(2) == options.dim(), "SpatialFusion: y must be [B, ", h * w,
            ", ", options.dim(), "] for a ", h, " x ", w, " grid, got ", y.sizes());
  DEW_CHECK(perm.defined() == inverse.defined(), "SpatialFusion: perm and inverse must be given together");
  const int64_t B = y.size(0), c = options.dim();
  // Scan order -> raster: raster slot k holds scan token inverse[k].
  const Tensor raster = perm.defined() ? y.index_select(1, inverse) : y;
  const Tensor grid = raster.transpose(1, 2).reshape({B, c, h, w});
  Tensor delta;
  for (const auto& layer : convs) {
    Tensor t = conv(grid, layer);
    delta = delta.defined() ? delta + t : t;
  }
  delta = delta.flatten(2).transpose(1, 2);  // [B, h w, D] raster
  if (perm.defined()) delta = delta.index_select(1, perm);
  return y + delta;
}

}  // namespace dew::nn
