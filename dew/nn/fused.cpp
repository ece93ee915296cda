#include "dew/nn/fused.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dew/core/error.h"
#include "dew/nn/autograd_detail.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DEW_SIMD_X86 1  // the kernels' intrinsics (dew/nn/simd.inc)
#include <immintrin.h>
#endif

// The kernels pass 64-byte vectors between always-inline helpers only; the ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dew::nn {

// ---- the kernels, compiled once per instruction set ----
namespace kernels {
#define DEW_SIMD_KERNELS "dew/nn/fused_kernels.inc"
#include "dew/nn/simd_variants.inc"
#undef DEW_SIMD_KERNELS
}  // namespace kernels

torch::autograd::variable_list detail::composite_grads(const Tensor& y, const std::vector<Tensor>& inputs, size_t n,
                                                       const Tensor& grad, size_t total) {
  torch::autograd::variable_list out(total);
  std::vector<Tensor> wrt;
  std::vector<size_t> slot;
  for (size_t i = 0; i < n; ++i)
    if (inputs[i].numel() > 0 && inputs[i].requires_grad()) {
      wrt.push_back(inputs[i]);
      slot.push_back(i);
    }
  if (wrt.empty()) return out;
  auto g = torch::autograd::grad({y}, wrt, {grad}, /*retain_graph=*/true, /*create_graph=*/true);
  for (size_t j = 0; j < slot.size(); ++j) out[slot[j]] = g[j];
  return out;
}

namespace {

using detail::composite_grads;

struct KernelSet {
  const char* isa;
  decltype(&kernels::base::gelu_forward) gelu_forward;
  decltype(&kernels::base::gelu_backward) gelu_backward;
  decltype(&kernels::base::span_moments) span_moments;
  decltype(&kernels::base::span_affine_silu) span_affine_silu;
  decltype(&kernels::base::span_silu_grad) span_silu_grad;
  decltype(&kernels::base::span_combine) span_combine;
  decltype(&kernels::base::rows_moments) rows_moments;
  decltype(&kernels::base::rows_affine_silu) rows_affine_silu;
  decltype(&kernels::base::rows_silu_grad) rows_silu_grad;
  decltype(&kernels::base::rows_combine) rows_combine;
  decltype(&kernels::base::attention_forward) attention_forward;
  decltype(&kernels::base::attention_backward) attention_backward;
  decltype(&kernels::base::adam_update) adam_update;
  decltype(&kernels::base::ema_update) ema_update;
  decltype(&kernels::base::sum_squares) sum_squares;
  decltype(&kernels::base::rms_rows_forward) rms_rows_forward;
  decltype(&kernels::base::rms_rows_backward) rms_rows_backward;
  decltype(&kernels::base::rope_row) rope_row;
  decltype(&kernels::base::rope_row_backward) rope_row_backward;
};

#define DEW_KERNEL_SET(NS)                                                                                          \
  KernelSet {                                                                                                       \
#NS, kernels::NS::gelu_forward, kernels::NS::gelu_backward, kernels::NS::span_moments,                          \
        kernels::NS::span_affine_silu, kernels::NS::span_silu_grad, kernels::NS::span_combine,                      \
        kernels::NS::rows_moments, kernels::NS::rows_affine_silu, kernels::NS::rows_silu_grad,                      \
        kernels::NS::rows_combine, kernels::NS::attention_forward, kernels::NS::attention_backward,                 \
        kernels::NS::adam_update, kernels::NS::ema_update, kernels::NS::sum_squares, kernels::NS::rms_rows_forward, \
        kernels::NS::rms_rows_backward, kernels::NS::rope_row, kernels::NS::rope_row_backward                       \
  }

bool cpu_has(const std::string& isa) {
#ifdef DEW_SIMD_X86
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "base";
}

KernelSet kernel_set(const std::string& isa) {
#ifdef DEW_SIMD_X86
  if (isa == "avx512") {
    KernelSet k = DEW_KERNEL_SET(avx512);
    // Attention takes the AVX2 build: measured faster than the AVX-512 one at 49 to 196 keys with heads of
    // 16 and 32 (196 keys x 16, 2 threads: 10.6 against 12.8 ms on a Sapphire Rapids Xeon; docs/benchmarks.md).
    // The small GEMM's tile is 6 rows x 2 vectors of columns, so with 16-float vectors a head of 16 (the
    // P v product and its gradients) fills no whole tile and runs on the one-vector tail.
    k.attention_forward = kernels::avx2::attention_forward;
    k.attention_backward = kernels::avx2::attention_backward;
    return k;
  }
  if (isa == "avx2") return DEW_KERNEL_SET(avx2);
#endif
  return DEW_KERNEL_SET(base);
}

// The widest variant this CPU runs, or DEW_FUSED_ISA's (avx512 | avx2 | base; one this CPU lacks, or
// another name, is ignored with a warning): how an AVX-512 machine measures what an AVX2 one runs.
std::string default_isa() {
  const std::string widest = cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "base";
  const char* env = std::getenv("DEW_FUSED_ISA");
  if (!env || !*env) return widest;
  const std::string asked = env;
  if ((asked == "avx512" || asked == "avx2" || asked == "base") && cpu_has(asked)) return asked;
  std::fprintf(stderr, "[dew warn] DEW_FUSED_ISA=%s: not one of avx512, avx2, base that this CPU runs; using %s\n", env,
               widest.c_str());
  return widest;
}

KernelSet& active() {
  static KernelSet k = kernel_set(default_isa());
  return k;
}

// Splits n items into parallel chunks of at least `grain`.
template <class F>
void parallel(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { f(begin, end); });
}

constexpr int64_t kElementGrain = 1 << 15;

// The element-wise kernels run over x's storage when it is dense; `like` gives dy the same strides.
Tensor dense_storage(const Tensor& t) { return t.is_non_overlapping_and_dense() ? t : t.contiguous(); }
Tensor same_strides(const Tensor& t, const Tensor& like) {
  if (t.strides() == like.strides()) return t;
  return at::empty_like(like).copy_(t);
}

// ---- GELU ----

struct GeluTanhFunction : public torch::autograd::Function<GeluTanhFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input) {
    const Tensor x = dense_storage(input);
    ctx->save_for_backward({input});  // the input itself, so a create_graph backward stays connected
    Tensor y = at::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const auto& k = active();
    parallel(x.numel(), kElementGrain, [&](int64_t b, int64_t e) { k.gelu_forward(xp + b, yp + b, e - b); });
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor input = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {Tensor()};
    // create_graph: a differentiable backward from ATen's formula.
    if (at::GradMode::is_enabled()) return {at::gelu_backward(grads[0], input, "tanh")};
    const Tensor x = dense_storage(input);
    const Tensor dy = same_strides(grads[0], x);
    Tensor dx = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *gp = dy.data_ptr<float>();
    float* dp = dx.data_ptr<float>();
    const auto& k = active();
    parallel(x.numel(), kElementGrain, [&](int64_t b, int64_t e) { k.gelu_backward(xp + b, gp + b, dp + b, e - b); });
    return {dx};
  }
};

// ---- GroupNorm + SiLU ----

// Layout of x: [B, C, S] with each channel's S values contiguous (NCHW), or [B, S, C] rows (channels last).
struct NormShape {
  int64_t B, C, S, G, cpg;
  bool rows;
};

NormShape norm_shape(const Tensor& x, int64_t groups) {
  NormShape s{x.size(0), x.size(1),          x.numel() / std::max<int64_t>(1, x.size(0) * x.size(1)),
              groups,    x.size(1) / groups, false};
  s.rows = x.dim() == 4 ? x.is_contiguous(at::MemoryFormat::ChannelsLast)
                        : x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d);
  s.rows = s.rows && !x.is_contiguous();  // a tensor contiguous both ways (S = 1 or C = 1) is NCHW here
  return s;
}

Tensor layout_of(const Tensor& t, const NormShape& s, int64_t dim) {
  if (!s.rows) return t.contiguous();
  return t.contiguous(dim == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast);
}

// Per-group statistics of one sample, in shifted coordinates: z - K for the group's shift K, where
// z = x + shift is what is normalised.
struct GroupStats {
  const float* shift;  // K: [B, G]
  const float* dmean;  // mean - K: [B, G]
  const float* rstd;   // [B, G]
};

// The composite the fused function computes: silu(group_norm(x + shift)); shift may be empty.
Tensor group_norm_silu_composite(const Tensor& x, const Tensor& shift, int64_t groups, const Tensor& weight,
                                 const Tensor& bias, double eps) {
  return at::silu(at::group_norm(add_channel_shift(x, shift), groups, weight, bias, eps));
}

// Per-channel K', a, b with silu(a (x - K') + b) = silu(gamma (z - mean) rstd + beta) for sample n:
// K' = K - shift[c] (so x - K' = z - K). `shift`: sample n's [C] shifts, or null.
void channel_affine(const NormShape& s, int64_t n, const GroupStats& st, const float* gamma, const float* beta,
                    const float* shift, float* centre, float* a, float* b) {
  for (int64_t c = 0; c < s.C; ++c) {
    const int64_t g = n * s.G + c / s.cpg;
    centre[c] = st.shift[g] - (shift ? shift[c] : 0.0f);
    a[c] = st.rstd[g] * gamma[c];
    b[c] = beta[c] - st.dmean[g] * a[c];
  }
}

// Outputs silu(group_norm(x + shift)) and x itself: a gradient reaching the second (a residual block's skip
// path) is added to dx inside the backward's last pass instead of by a separate add.
struct GroupNormSiluFunction : public torch::autograd::Function<GroupNormSiluFunction> {
  // shift: [B, C], or empty for none.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& input,
                                                const Tensor& weight, const Tensor& bias, const Tensor& shift,
                                                int64_t groups, double eps) {
    const NormShape s = norm_shape(input, groups);
    const Tensor x = layout_of(input, s, input.dim());
    const Tensor w = weight.contiguous(), bi = bias.contiguous(), sh = shift.contiguous();
    Tensor stats = at::empty({3, s.B, s.G}, x.options());  // K, mean - K, rstd
    Tensor y = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = bi.data_ptr<float>();
    const float* shp = sh.numel() > 0 ? sh.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    float *kp = stats.data_ptr<float>(), *dmp = kp + s.B * s.G, *rp = dmp + s.B * s.G;
    const GroupStats st{kp, dmp, rp};
    const auto& k = active();
    const double count = static_cast<double>(s.cpg * s.S);
    // sum(z - K) and sum((z - K)^2) with K the group's first value: var = E[(z-K)^2] - E[z-K]^2 in one pass.
    auto finish = [&](int64_t ng, double sum, double sq, float shift_k) {
      const double dm = sum / count;
      kp[ng] = shift_k;
      dmp[ng] = static_cast<float>(dm);
      rp[ng] = static_cast<float>(1.0 / std::sqrt(std::max(0.0, sq / count - dm * dm) + eps));
    };
    if (!s.rows) {
      parallel(s.B * s.G, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bg = begin; bg < end; ++bg) {
          const int64_t n = bg / s.G, c0 = (bg % s.G) * s.cpg;
          const float* xg = xp + bg * s.cpg * s.S;  // the group's channels are consecutive spans
          const float* shn = shp ? shp + n * s.C : nullptr;
          auto centre = [&](float K, int64_t c) { return shn ? K - shn[c] : K; };
          const float K = shn ? xg[0] + shn[c0] : xg[0];
          double sum = 0, sq = 0;
          for (int64_t c = c0; c < c0 + s.cpg; ++c) k.span_moments(xg + (c - c0) * s.S, s.S, centre(K, c), &sum, &sq);
          finish(bg, sum, sq, K);
          for (int64_t c = c0; c < c0 + s.cpg; ++c) {
            const float a = rp[bg] * wp[c], b = bp[c] - dmp[bg] * a;
            const int64_t off = (n * s.C + c) * s.S;
            k.span_affine_silu(xp + off, yp + off, s.S, centre(K, c), a, b);
          }
        }
      });
    } else {
      parallel(s.B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> centre(s.C), a(s.C), b(s.C);
        std::vector<double> sum(s.C), sq(s.C);
        for (int64_t n = begin; n < end; ++n) {
          const float* xn = xp + n * s.S * s.C;
          const float* shn = shp ? shp + n * s.C : nullptr;
          // K: the group's first z value (first pixel, first channel); moments of x around K - shift[c].
          auto group_k = [&](int64_t g) { return xn[g * s.cpg] + (shn ? shn[g * s.cpg] : 0.0f); };
          for (int64_t c = 0; c < s.C; ++c) centre[c] = group_k(c / s.cpg) - (shn ? shn[c] : 0.0f);
          std::fill(sum.begin(), sum.end(), 0.0);
          std::fill(sq.begin(), sq.end(), 0.0);
          k.rows_moments(xn, s.S, s.C, centre.data(), sum.data(), sq.data());
          for (int64_t g = 0; g < s.G; ++g) {
            double gs = 0, gq = 0;
            for (int64_t c = g * s.cpg; c < (g + 1) * s.cpg; ++c) {
              gs += sum[c];
              gq += sq[c];
            }
            finish(n * s.G + g, gs, gq, group_k(g));
          }
          channel_affine(s, n, st, wp, bp, shn, centre.data(), a.data(), b.data());
          k.rows_affine_silu(xn, yp + n * s.S * s.C, s.S, s.C, centre.data(), a.data(), b.data());
        }
      });
    }
    // The inputs themselves (x, w and bi are the same tensors unless a copy was needed), so a
    // create_graph backward stays connected to them.
    ctx->save_for_backward({input, weight, bias, shift, stats});
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined, not a tensor of zeros
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["eps"] = eps;
    return {y, input};  // autograd returns the input as a view of itself with this node as its grad_fn
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    torch::autograd::variable_list out(6);
    const Tensor& skip_grad = grads[1];  // the gradient of the second output (x), or undefined
    if (!grads[0].defined()) {
      out[0] = skip_grad;
      return out;
    }
    if (at::GradMode::is_enabled()) {
      const double eps = ctx->saved_data["eps"].toDouble();
      const Tensor y = group_norm_silu_composite(saved[0], saved[3], groups, saved[1], saved[2], eps);
      out = composite_grads(y, saved, 4, grads[0], 6);
      if (skip_grad.defined()) out[0] = out[0].defined() ? out[0] + skip_grad : skip_grad;
      return out;
    }
    const NormShape s = norm_shape(saved[0], groups);
    const Tensor x = layout_of(saved[0], s, saved[0].dim());
    const Tensor w = saved[1].contiguous(), bi = saved[2].contiguous(), sh = saved[3].contiguous(), stats = saved[4];
    const Tensor dy = layout_of(grads[0], s, x.dim());
    const Tensor skip = skip_grad.defined() ? layout_of(skip_grad, s, x.dim()) : Tensor();
    const float* skp = skip.defined() ? skip.data_ptr<float>() : nullptr;
    Tensor dx = at::empty_like(x);
    // Per (sample, channel) sums of the SiLU-side gradient g, of g (z - K) and of z - K; reduced over the
    // batch at the end.
    Tensor sums = at::empty({3, s.B, s.C}, x.options().dtype(at::kDouble));
    const bool has_shift = sh.numel() > 0;
    Tensor dshift = has_shift ? at::empty({s.B, s.C}, x.options()) : Tensor();
    const float *xp = x.data_ptr<float>(), *gp = dy.data_ptr<float>(), *wp = w.data_ptr<float>(),
                *bp = bi.data_ptr<float>(), *kp = stats.data_ptr<float>();
    const float* shp = has_shift ? sh.data_ptr<float>() : nullptr;
    float* dshp = has_shift ? dshift.data_ptr<float>() : nullptr;
    const GroupStats st{kp, kp + s.B * s.G, kp + 2 * s.B * s.G};
    float* dp = dx.data_ptr<float>();
    double* sg = sums.data_ptr<double>();
    double* sgx = sg + s.B * s.C;
    double* sx = sgx + s.B * s.C;
    const auto& k = active();
    const double count = static_cast<double>(s.cpg * s.S);
    // dz = rstd (gamma g - mean(gamma g) - zhat mean(gamma g zhat)) = p_c g + q (z - K) + r per group.
    auto group_coefficients = [&](int64_t n, int64_t grp, float* p, float* q, float* r) {
      const int64_t ng = n * s.G + grp;
      const double dm = st.dmean[ng], rs = st.rstd[ng];
      double m1 = 0, m2 = 0;
      for (int64_t c = grp * s.cpg; c < (grp + 1) * s.cpg; ++c) {
        const int64_t nc = n * s.C + c;
        m1 += wp[c] * sg[nc];
        m2 += wp[c] * rs * (sgx[nc] - dm * sg[nc]);
      }
      m1 /= count;
      m2 /= count;
      for (int64_t c = grp * s.cpg; c < (grp + 1) * s.cpg; ++c) p[c] = static_cast<float>(rs * wp[c]);
      *q = static_cast<float>(-rs * rs * m2);
      *r = static_cast<float>(rs * (rs * m2 * dm - m1));
    };
    // d shift[n, c] = sum over the channel's positions of dz = p sum g + q sum (z - K) + r S.
    auto shift_grad = [&](int64_t nc, float p, float q, float r) {
      if (dshp) dshp[nc] = static_cast<float>(p * sg[nc] + q * sx[nc] + r * static_cast<double>(s.S));
    };
    if (!s.rows) {
      parallel(s.B * s.G, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(s.C);
        for (int64_t bg = begin; bg < end; ++bg) {
          const int64_t n = bg / s.G, grp = bg % s.G, c0 = grp * s.cpg;
          auto centre = [&](int64_t c) { return shp ? st.shift[bg] - shp[n * s.C + c] : st.shift[bg]; };
          for (int64_t c = c0; c < c0 + s.cpg; ++c) {
            const int64_t nc = n * s.C + c, off = nc * s.S;
            const float a = st.rstd[bg] * wp[c], b = bp[c] - st.dmean[bg] * a;
            sg[nc] = sgx[nc] = sx[nc] = 0;
            k.span_silu_grad(xp + off, gp + off, dp + off, s.S, centre(c), a, b, &sg[nc], &sgx[nc], &sx[nc]);
          }
          float q, r;
          group_coefficients(n, grp, p.data(), &q, &r);
          for (int64_t c = c0; c < c0 + s.cpg; ++c) {
            const int64_t off = (n * s.C + c) * s.S;
            k.span_combine(dp + off, xp + off, skp ? skp + off : nullptr, s.S, centre(c), p[c], q, r);
            shift_grad(n * s.C + c, p[c], q, r);
          }
        }
      });
    } else {
      parallel(s.B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> centre(s.C), a(s.C), b(s.C), p(s.C), q(s.C), r(s.C);
        for (int64_t n = begin; n < end; ++n) {
          const int64_t off = n * s.S * s.C;
          double *sgn = sg + n * s.C, *sgxn = sgx + n * s.C, *sxn = sx + n * s.C;
          channel_affine(s, n, st, wp, bp, shp ? shp + n * s.C : nullptr, centre.data(), a.data(), b.data());
          std::fill(sgn, sgn + s.C, 0.0);
          std::fill(sgxn, sgxn + s.C, 0.0);
          std::fill(sxn, sxn + s.C, 0.0);
          k.rows_silu_grad(xp + off, gp + off, dp + off, s.S, s.C, centre.data(), a.data(), b.data(), sgn, sgxn, sxn);
          for (int64_t grp = 0; grp < s.G; ++grp) {
            float qg, rg;
            group_coefficients(n, grp, p.data(), &qg, &rg);
            std::fill(q.begin() + grp * s.cpg, q.begin() + (grp + 1) * s.cpg, qg);
            std::fill(r.begin() + grp * s.cpg, r.begin() + (grp + 1) * s.cpg, rg);
          }
          k.rows_combine(dp + off, xp + off, skp ? skp + off : nullptr, s.S, s.C, centre.data(), p.data(), q.data(),
                         r.data());
          for (int64_t c = 0; c < s.C; ++c) shift_grad(n * s.C + c, p[c], q[c], r[c]);
        }
      });
    }
    // dbeta = sum g; dgamma = sum g zhat = rstd (sum g (z - K) - (mean - K) sum g), over the batch.
    Tensor dgamma = at::empty({s.C}, x.options()), dbeta = at::empty({s.C}, x.options());
    float *dgp = dgamma.data_ptr<float>(), *dbp = dbeta.data_ptr<float>();
    for (int64_t c = 0; c < s.C; ++c) {
      double gsum = 0, bsum = 0;
      for (int64_t n = 0; n < s.B; ++n) {
        const int64_t nc = n * s.C + c, ng = n * s.G + c / s.cpg;
        gsum += static_cast<double>(st.rstd[ng]) * (sgx[nc] - static_cast<double>(st.dmean[ng]) * sg[nc]);
        bsum += sg[nc];
      }
      dgp[c] = static_cast<float>(gsum);
      dbp[c] = static_cast<float>(bsum);
    }
    out[0] = dx;
    out[1] = dgamma;
    out[2] = dbeta;
    if (has_shift && saved[3].requires_grad()) out[3] = dshift;
    return out;
  }
};

// ---- attention ----

// A [B, H, S, D] view whose rows are D contiguous floats; anything else is copied once.
Tensor rows_view(const Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

// Storage [B, S, H, D] seen as [B, H, S, D]: what merge_heads reads back without a copy.
Tensor heads_last(int64_t B, int64_t H, int64_t S, int64_t D, const at::TensorOptions& o) {
  return at::empty({B, S, H, D}, o).permute({0, 2, 1, 3});
}

constexpr int64_t kRowStride = 2;  // stride index of the S axis in a [B, H, S, D] tensor

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q_in, const Tensor& k_in,
                        const Tensor& v_in) {
    const Tensor q = rows_view(q_in), k = rows_view(k_in), v = rows_view(v_in);
    const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
    Tensor o = heads_last(B, H, Sq, D, q.options());
    Tensor p = at::empty({B, H, Sq, Sk}, q.options());
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    const auto& kern = active();
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    float *op = o.data_ptr<float>(), *pp = p.data_ptr<float>();
    const int64_t scratch = D * ((Sk + 15) / 16 * 16);  // the transposed keys, padded for any variant
    parallel(B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(scratch);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        auto at_ = [&](const float* base, const Tensor& t) { return base + b * t.stride(0) + h * t.stride(1); };
        kern.attention_forward(at_(qp, q), q.stride(kRowStride), at_(kp, k), k.stride(kRowStride), at_(vp, v),
                               v.stride(kRowStride), op + b * o.stride(0) + h * o.stride(1), o.stride(kRowStride),
                               pp + bh * Sq * Sk, Sq, Sk, D, scale, buf.data());
      }
    });
    ctx->save_for_backward({q_in, k_in, v_in, p});
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    if (at::GradMode::is_enabled()) {
      const double sc = 1.0 / std::sqrt(static_cast<double>(saved[0].size(3)));
      const Tensor o = at::matmul(at::softmax(at::matmul(saved[0] * sc, saved[1].transpose(-2, -1)), -1), saved[2]);
      return composite_grads(o, saved, 3, grads[0], 3);
    }
    const Tensor q = rows_view(saved[0]), k = rows_view(saved[1]), v = rows_view(saved[2]), p = saved[3];
    const Tensor dout = rows_view(grads[0]);
    const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
    Tensor dq = heads_last(B, H, Sq, D, q.options()), dk = heads_last(B, H, Sk, D, q.options()),
           dv = heads_last(B, H, Sk, D, q.options());
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    const auto& kern = active();
    const int64_t scratch = D * ((Sk + 15) / 16 * 16) + Sq * Sk;  // the transposed values, padded; dS
    parallel(B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(scratch);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        auto in = [&](const Tensor& t) { return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1); };
        auto out = [&](Tensor& t) { return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1); };
        kern.attention_backward(in(q), q.stride(kRowStride), in(k), k.stride(kRowStride), in(v), v.stride(kRowStride),
                                p.data_ptr<float>() + bh * Sq * Sk, in(dout), dout.stride(kRowStride), out(dq),
                                dq.stride(kRowStride), out(dk), dk.stride(kRowStride), out(dv), dv.stride(kRowStride),
                                Sq, Sk, D, scale, buf.data());
      }
    });
    return {dq, dk, dv};
  }
};

// ---- RMSNorm ----

// Rows per block of the RMSNorm kernels: the weight gradient is summed per block, then over the blocks in
// order, so it does not depend on the thread count.
constexpr int64_t kRmsRowBlock = 64;

Tensor rms_norm_composite(const Tensor& x, const Tensor& weight, double eps, double offset) {
  const Tensor xf = x.to(at::kFloat);
  Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const Tensor w = weight.to(at::kFloat);
  return (y * (offset != 0.0 ? w + offset : w)).to(x.scalar_type());
}

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input, const Tensor& weight, double eps,
                        double offset) {
    const int64_t D = input.size(-1), rows = input.numel() / D;
    const Tensor x = input.contiguous(), w = weight.contiguous();
    Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    Tensor rstd = at::empty({rows}, x.options());
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
    const auto& k = active();
    const auto e = static_cast<float>(eps), o = static_cast<float>(offset);
    parallel(rows, std::max<int64_t>(1, kElementGrain / D),
             [&](int64_t b, int64_t end) { k.rms_rows_forward(xp + b * D, wp, yp + b * D, rp + b, end - b, D, e, o); });
    ctx->save_for_backward({input, weight, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double eps = ctx->saved_data["eps"].toDouble(), offset = ctx->saved_data["offset"].toDouble();
    torch::autograd::variable_list out(4);
    if (!grads[0].defined()) return out;
    if (at::GradMode::is_enabled())
      return composite_grads(rms_norm_composite(saved[0], saved[1], eps, offset), saved, 2, grads[0], 4);
    const Tensor x = saved[0].contiguous(), w = saved[1].contiguous(), rstd = saved[2];
    const Tensor dy = grads[0].contiguous();
    const int64_t D = x.size(-1), rows = x.numel() / D, blocks = (rows + kRmsRowBlock - 1) / kRmsRowBlock;
    const bool want_w = saved[1].requires_grad();
    Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    Tensor partial = want_w ? at::zeros({blocks, D}, x.options()) : Tensor();
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *gp = dy.data_ptr<float>(),
                *rp = rstd.data_ptr<float>();
    float* dp = dx.data_ptr<float>();
    float* pp = want_w ? partial.data_ptr<float>() : nullptr;
    const auto& k = active();
    const auto o = static_cast<float>(offset);
    parallel(blocks, std::max<int64_t>(1, kElementGrain / (D * kRmsRowBlock)), [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t r0 = blk * kRmsRowBlock, n = std::min(kRmsRowBlock, rows - r0);
        k.rms_rows_backward(xp + r0 * D, wp, gp + r0 * D, rp + r0, dp + r0 * D, pp ? pp + blk * D : nullptr, n, D, o);
      }
    });
    out[0] = saved[0].requires_grad() ? dx : Tensor();
    if (want_w) {
      // The blocks' sums in block order, in double.
      std::vector<double> acc(static_cast<size_t>(D), 0.0);
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int64_t j = 0; j < D; ++j) acc[size_t(j)] += pp[blk * D + j];
      Tensor dw = at::empty({D}, x.options());
      float* dwp = dw.data_ptr<float>();
      for (int64_t j = 0; j < D; ++j) dwp[j] = static_cast<float>(acc[size_t(j)]);
      out[1] = dw;
    }
    return out;
  }
};

// ---- rotate-half RoPE ----

// The kernels' view of x [B, H, S, D] (last dimension contiguous, any other strides) and of the tables
// [S, D] or [B, 1, S, D] (contiguous): row (b, h, s) of x and its table row.
struct RopeRows {
  int64_t B, H, S, D;
  std::array<int64_t, 3> xs;  // x's strides over b, h, s
  int64_t table_batch;        // the tables' stride over b (0 for [S, D] tables)
};

RopeRows rope_rows(const Tensor& x, const Tensor& table) {
  return {x.size(0),
          x.size(1),
          x.size(2),
          x.size(3),
          {x.stride(0), x.stride(1), x.stride(2)},
          table.dim() == 4 ? x.size(2) * x.size(3) : 0};
}

// Calls f(x row offset, table row offset, y row offset) for every row of x, in parallel; y has y_strides.
template <class F>
void for_rope_rows(const RopeRows& r, at::IntArrayRef ys, const F& f) {
  parallel(r.B * r.H * r.S, std::max<int64_t>(1, kElementGrain / r.D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i % r.S, h = (i / r.S) % r.H, b = i / (r.S * r.H);
      f(b * r.xs[0] + h * r.xs[1] + s * r.xs[2], b * r.table_batch + s * r.D, b * ys[0] + h * ys[1] + s * ys[2]);
    }
  });
}

Tensor rope_composite(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const Tensor xf = x.to(at::kFloat);
  const int64_t half = x.size(-1) / 2;
  Tensor rotated = at::cat({-xf.narrow(-1, half, half), xf.narrow(-1, 0, half)}, -1);
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    const Tensor c = cos.contiguous(), s = sin.contiguous();
    const RopeRows r = rope_rows(x, c);
    Tensor y = at::empty_like(x);  // x's layout (the heads of a [B, S, H, D] projection stay in place)
    const float *xp = x.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const auto& k = active();
    for_rope_rows(r, y.strides(),
                  [&](int64_t xo, int64_t to, int64_t yo) { k.rope_row(xp + xo, cp + to, sp + to, yp + yo, r.D / 2); });
    ctx->save_for_backward({c, s});  // the rotation is linear: backward needs only the tables
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &c = saved[0], &s = saved[1];
    torch::autograd::variable_list out(3);
    if (!grads[0].defined()) return out;
    if (at::GradMode::is_enabled()) {
      // create_graph: the transposed rotation in differentiable ATen ops.
      const int64_t half = grads[0].size(-1) / 2;
      const Tensor gs = grads[0] * s;
      out[0] = grads[0] * c + at::cat({gs.narrow(-1, half, half), -gs.narrow(-1, 0, half)}, -1);
      return out;
    }
    const Tensor dy = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    const RopeRows r = rope_rows(dy, c);
    Tensor dx = at::empty_like(dy);
    const float *gp = dy.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    float* dp = dx.data_ptr<float>();
    const auto& k = active();
    for_rope_rows(r, dx.strides(), [&](int64_t go, int64_t to, int64_t xo) {
      k.rope_row_backward(gp + go, cp + to, sp + to, dp + xo, r.D / 2);
    });
    out[0] = dx;
    return out;
  }
};

// ---- linear ----

}  // namespace

bool fused_kernels_apply(const Tensor& x) {
  return x.defined() && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.layout() == at::kStrided;
}

Tensor gelu_tanh(const Tensor& x) {
  if (!fused_kernels_apply(x) || x.numel() == 0) return at::gelu(x, "tanh");
  return GeluTanhFunction::apply(x);
}

void check_channel_shift(const Tensor& x, const Tensor& shift) {
  DEW_CHECK(!shift.defined() || shift.numel() == 0 ||
                (x.dim() >= 2 && shift.dim() == 2 && shift.size(0) == x.size(0) && shift.size(1) == x.size(1)),
            "group norm: shift must be [", x.size(0), ", ", x.size(1), "] (batch, channels), got ", shift.sizes());
}

Tensor add_channel_shift(const Tensor& x, const Tensor& shift) {
  check_channel_shift(x, shift);
  if (!shift.defined() || shift.numel() == 0) return x;
  std::vector<int64_t> view(static_cast<size_t>(x.dim()), 1);
  view[0] = shift.size(0);
  view[1] = shift.size(1);
  return x + shift.view(view);
}

std::array<Tensor, 2> group_norm_silu_and_input(const Tensor& x, int64_t groups, const Tensor& weight,
                                                const Tensor& bias, double eps, const Tensor& shift) {
  DEW_CHECK(x.dim() >= 2, "group_norm_silu: x must be [B, C, ...], got ", x.sizes());
  DEW_CHECK(groups > 0 && x.size(1) % groups == 0, "group_norm_silu: groups must divide the channels (", x.size(1),
            "), got ", groups);
  check_channel_shift(x, shift);
  // SSE2 only: the NCHW kernel is slower than the composite (2.8 vs 1.3 ms at 32 x 32 x 28 x 28), the
  // channels-last one faster (3.1 vs 7.5 ms): measured per variant in bench/bench_fused.cpp.
  const bool slower_here = std::strcmp(active().isa, "base") == 0 && x.is_contiguous();
  const bool fused = fused_kernels_apply(x) && x.numel() > 0 && weight.defined() && bias.defined() &&
                     fused_kernels_apply(weight) && fused_kernels_apply(bias) &&
                     (!shift.defined() || fused_kernels_apply(shift)) && !slower_here;
  const Tensor sh = shift.defined() ? shift : at::empty({0}, x.options());
  if (!fused) return {group_norm_silu_composite(x, sh, groups, weight, bias, eps), x};
  auto out = GroupNormSiluFunction::apply(x, weight, bias, sh, groups, eps);
  return {out[0], out[1]};
}

Tensor group_norm_silu(const Tensor& x, int64_t groups, const Tensor& weight, const Tensor& bias, double eps,
                       const Tensor& shift) {
  return group_norm_silu_and_input(x, groups, weight, bias, eps, shift)[0];
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, double offset) {
  DEW_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [",
            x.dim() >= 1 ? x.size(-1) : 0, "] (x's last dimension), got ", weight.sizes());
  const bool fused = fused_kernels_apply(x) && fused_kernels_apply(weight) && x.numel() > 0;
  if (!fused) return rms_norm_composite(x, weight, eps, offset);
  return RmsNormFunction::apply(x, weight, eps, offset);
}

Tensor rope_rotate(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const bool tables_4d = cos.dim() == 4 && cos.size(0) == x.size(0) && cos.size(1) == 1;
  const bool fused = fused_kernels_apply(x) && fused_kernels_apply(cos) && fused_kernels_apply(sin) && x.dim() == 4 &&
                     x.numel() > 0 && x.stride(3) == 1 && x.size(3) % 2 == 0 && cos.sizes() == sin.sizes() &&
                     (cos.dim() == 2 || tables_4d) && cos.size(-2) == x.size(2) && cos.size(-1) == x.size(3) &&
                     !cos.requires_grad() && !sin.requires_grad();
  if (!fused) return rope_composite(x, cos, sin);
  return RopeFunction::apply(x, cos, sin);
}

bool fused_attention_applies(const Tensor& q, const Tensor& k, const Tensor& v) {
  return fused_kernels_apply(q) && fused_kernels_apply(k) && fused_kernels_apply(v) && q.dim() == 4 && k.dim() == 4 &&
         v.dim() == 4 && q.numel() > 0 && k.numel() > 0 &&
         q.sizes() == at::IntArrayRef({k.size(0), k.size(1), q.size(2), k.size(3)}) && v.sizes() == k.sizes();
}

bool fused_attention_preferred(int64_t keys) { return keys <= kFusedAttentionMaxKeys; }

Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  DEW_CHECK(fused_attention_applies(q, k, v),
            "fused_attention: needs float32 CPU q [B, H, Sq, D] and k, v [B, H, Sk, D]"
            ", got ",
            q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  return AttentionFunction::apply(q, k, v);
}

// At most this many rows take one matrix-vector product per row (decoding's single token): OpenBLAS's
// GEMM (0.3.21) packs the whole weight on every call, about 5x the time of its GEMV on one row
// (68 vs 13 us at 768 x 256, one thread); at 8 rows one GEMM is already the faster.
constexpr int64_t kGemvRows = 4;

// x [..., K] with at most kGemvRows rows: y[i] = W x[i] (+ b) by GEMV. The same BLAS call with or without
// autograd (there through the differentiable at::addmv / at::mv), so a forward gives the same bits in
// both modes (remat's recomputation, a no-grad evaluation of a trained step).
Tensor linear_by_rows(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  const int64_t K = input.size(-1), N = weight.size(0);
  const Tensor x = input.reshape({-1, K});
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = N;
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (needs_grad) {
    std::vector<Tensor> rows;
    for (int64_t i = 0; i < x.size(0); ++i)
      rows.push_back(bias.defined() ? at::addmv(bias, weight, x.select(0, i)) : at::mv(weight, x.select(0, i)));
    return at::stack(rows).view(shape);
  }
  Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t i = 0; i < x.size(0); ++i) {
    Tensor row = y.select(0, i);
    if (bias.defined()) {
      at::addmv_out(row, bias, weight, x.select(0, i));
    } else {
      at::mv_out(row, weight, x.select(0, i));
    }
  }
  return y.view(shape);
}

Tensor row_parallel_linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (fused_kernels_apply(x) && fused_kernels_apply(weight) && (!bias.defined() || fused_kernels_apply(bias)) &&
      x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) && x.numel() > 0 &&
      x.numel() / x.size(-1) <= kGemvRows)
    return linear_by_rows(x, weight, bias);
  return at::linear(x, weight, bias);
}

namespace {

// A float32 CPU tensor the update kernels can walk as one span.
bool flat_float(const Tensor& t) { return fused_kernels_apply(t) && t.is_contiguous(); }

constexpr int64_t kUpdateGrain = 1 << 16;

}  // namespace

bool fused_adam_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamCoefficients& c) {
  if (!flat_float(p) || !flat_float(g) || !flat_float(m) || !flat_float(v) || g.numel() != p.numel() ||
      m.numel() != p.numel() || v.numel() != p.numel())
    return false;
  const float k[7] = {static_cast<float>(c.l2),    static_cast<float>(c.beta1), static_cast<float>(c.beta2),
                      static_cast<float>(c.decay), static_cast<float>(c.step),  static_cast<float>(1.0 / c.bc2),
                      static_cast<float>(c.eps)};
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const auto& kern = active();
  parallel(p.numel(), kUpdateGrain,
           [&](int64_t b, int64_t e) { kern.adam_update(pp + b, gp + b, mp + b, vp + b, e - b, k); });
  return true;
}

bool fused_ema_update(const Tensor& avg, const Tensor& p, double decay) {
  if (!flat_float(avg) || !flat_float(p) || avg.numel() != p.numel()) return false;
  float* ap = avg.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  const auto& kern = active();
  const float d = static_cast<float>(decay);
  parallel(p.numel(), kUpdateGrain, [&](int64_t b, int64_t e) { kern.ema_update(ap + b, pp + b, e - b, d); });
  return true;
}

double sum_of_squares(const Tensor& x) {
  if (!flat_float(x)) return x.to(at::kDouble).square().sum().item<double>();
  return active().sum_squares(x.data_ptr<float>(), x.numel());
}

std::string fused_kernel_isa() { return active().isa; }

void set_fused_kernel_isa(const std::string& isa) {
  DEW_CHECK(isa == "avx512" || isa == "avx2" || isa == "base", "fused kernels: isa: got \"", isa,
            "\", accepted: avx512, avx2, base");
  DEW_CHECK(cpu_has(isa), "fused kernels: isa \"", isa, "\" is not supported by this CPU (or this build)");
  active() = kernel_set(isa);
}

}  // namespace dew::nn
