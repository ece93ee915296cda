// Micro-benchmarks of the fused CPU kernels (dew/nn/fused.h) against the ATen ops they replace, at the
// shapes of `dew bench`'s models, each fused kernel once per instruction set it dispatches to (avx512,
// avx2, base = SSE2; a set this CPU lacks is skipped with a message):
//   GELU-tanh, GroupNorm + SiLU (NCHW, channels-last), attention   forward + backward
//   RMSNorm (the lm's 4 x 256 tokens of width 256, and its q/k heads of 64) forward + backward (dx, dw)
//   rotate-half RoPE (the lm's q: 4 x 4 heads x 256 tokens x 64)     forward + backward
//   few-rows linear (a decoding step, 1 row, 256 -> 768, no gradient) forward
//   channel shift (unet's time embedding added to 32 x 32 x 28 x 28) forward + backward
//   Adam(W) update, EMA update, sum of squares (1M float32 parameters) one pass each
//   Winograd 3 x 3 convolution (dew/nn/winograd.h) at the unet's shapes, batch 32, channels-last
//                                                                 forward alone, or forward + backward (dx, dw, db)
// Args: intra-op threads (1, 2) and, for attention, tokens and head width; for the convolution, input and
// output channels, the image side and 1 for a training step (0: forward without gradients).
//   OPENBLAS_NUM_THREADS=1 build/dew_microbench --benchmark_filter=Fused
#include <benchmark/benchmark.h>

#include <torch/torch.h>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/fused.h"
#include "dew/nn/winograd.h"

namespace {

using at::Tensor;

// Selects the kernels of `isa` ("" = ATen: nothing to select); false (the benchmark skipped) when this CPU
// lacks it.
bool use_isa(benchmark::State& state, const std::string& isa) {
  if (isa.empty()) return true;
  try {
    dew::nn::set_fused_kernel_isa(isa);
  } catch (const dew::Error& e) {
    state.SkipWithError(e.what());
    return false;
  }
  state.SetLabel(isa);
  return true;
}

void run_step(benchmark::State& state, const Tensor& x0, const std::function<Tensor(const Tensor&)>& f) {
  Tensor x = x0.clone().requires_grad_();
  Tensor g = torch::randn_like(f(x).detach());
  for (auto _ : state) {
    Tensor y = f(x);
    y.backward(g);
    x.mutable_grad().reset();
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * x0.numel());
}

void BM_FusedGeluTanh(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const bool fused = !isa.empty();
  run_step(state, torch::randn({32 * 49, 512}),
           [fused](const Tensor& x) { return fused ? dew::nn::gelu_tanh(x) : at::gelu(x, "tanh"); });
}

void BM_FusedGroupNormSilu(benchmark::State& state, std::string isa, bool channels_last) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const bool fused = !isa.empty();
  Tensor x = torch::randn({32, 32, 28, 28});
  if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  Tensor w = torch::ones({32}).requires_grad_(), b = torch::zeros({32}).requires_grad_();
  run_step(state, x, [=](const Tensor& in) {
    return fused ? dew::nn::group_norm_silu(in, 8, w, b, 1e-5) : at::silu(at::group_norm(in, 8, w, b, 1e-5));
  });
}

void BM_FusedGroupNormSiluNchw(benchmark::State& state, std::string isa) { BM_FusedGroupNormSilu(state, isa, false); }
void BM_FusedGroupNormSiluChannelsLast(benchmark::State& state, std::string isa) {
  BM_FusedGroupNormSilu(state, isa, true);
}

// softmax(q k^T / sqrt(D)) v, forward + backward for q, k, v: simple_dit's 32 x 4 heads x 49 tokens x 32,
// the most keys it takes, 128 (head 16), and unet_attn's 196 tokens (14 x 14) of head 16.
void BM_FusedAttention(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  const int64_t S = state.range(1), D = state.range(2);
  const bool fused = !isa.empty();
  torch::manual_seed(0);
  Tensor qkv = torch::randn({32, S, 3, 4, D}).requires_grad_();
  Tensor g = torch::randn({32, 4, S, D});
  for (auto _ : state) {
    auto t = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
    // "aten": at::scaled_dot_product_attention, which attention_impl "auto" runs where the fused kernel is not taken.
    Tensor o = fused ? dew::nn::fused_attention(t[0], t[1], t[2]) : dew::nn::attention(t[0], t[1], t[2], {}, "sdpa");
    o.backward(g);
    qkv.mutable_grad().reset();
    benchmark::DoNotOptimize(o.data_ptr());
  }
}

// RMSNorm at the lm bench's shapes: range(1) = 0 for its hidden states [4, 256, 256], 1 for its q/k heads
// [4, 256, 4, 64]; forward and backward with the weight's gradient.
void BM_FusedRmsNorm(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const bool fused = !isa.empty(), heads = state.range(1) == 1;
  const int64_t D = heads ? 64 : 256;
  Tensor w = (torch::randn({D}) * 0.1 + 1).requires_grad_();
  run_step(state, heads ? torch::randn({4, 256, 4, 64}) : torch::randn({4, 256, 256}), [=](const Tensor& x) {
    return fused ? dew::nn::rms_norm(x, w, 1e-5) : x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * w;
  });
}

// RoPE on the lm bench's q as the projection leaves it ([4, 256, 4, 64] seen as [4, 4, 256, 64]).
void BM_FusedRope(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const bool fused = !isa.empty();
  const auto rope = dew::nn::rope_1d(torch::arange(256), 64);
  Tensor x0 = torch::randn({4, 256, 4, 64});
  Tensor x = x0.transpose(1, 2).detach().requires_grad_();
  Tensor g = torch::randn({4, 4, 256, 64});
  for (auto _ : state) {
    Tensor y;
    if (fused) {
      y = dew::nn::rope_rotate(x, rope.cos, rope.sin);
    } else {
      Tensor rotated = at::cat({-x.narrow(-1, 32, 32), x.narrow(-1, 0, 32)}, -1);
      y = x * rope.cos + rotated * rope.sin;
    }
    y.backward(g);
    x.mutable_grad().reset();
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
}

// A decoding step's projection: 1 row, 256 -> 768, no gradient: GEMV per row against at::linear's GEMM.
void BM_FewRowsLinear(benchmark::State& state, bool fused) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  torch::NoGradGuard ng;
  Tensor w = torch::randn({768, 256}) * 0.05, x = torch::randn({1, 1, 256});
  for (auto _ : state) {
    Tensor y = fused ? dew::nn::row_parallel_linear(x, w, {}) : at::linear(x, w);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetLabel(fused ? "gemv" : "aten");
}

// The demo unet's time-embedding shift, [32, 32] over 32 x 32 x 28 x 28, forward and backward.
void BM_FusedChannelShift(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const bool fused = !isa.empty();
  Tensor shift = torch::randn({32, 32}).requires_grad_();
  run_step(state, torch::randn({32, 32, 28, 28}), [=](const Tensor& x) {
    return fused ? dew::nn::add_channel_shift(x, shift) : x + shift.view({32, 32, 1, 1});
  });
}

constexpr int64_t kParameters = int64_t(1) << 20;  // about simple_dit's 0.8M, rounded up

// One AdamW update of kParameters float32 values: the fused pass, or the ATen ops optim.cpp would run.
void BM_FusedAdamW(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  Tensor p = torch::randn({kParameters}), g = torch::randn({kParameters}) * 1e-3;
  Tensor m = torch::zeros({kParameters}), v = torch::zeros({kParameters});
  dew::nn::AdamCoefficients c;
  c.decay = 1 - 1e-3 * 0.01;
  c.step = 1e-3;
  c.bc2 = 0.5;
  for (auto _ : state) {
    if (!isa.empty()) {
      DEW_CHECK(dew::nn::fused_adam_update(p, g, m, v, c), "fused adam did not apply");
    } else {
      m.mul_(c.beta1).add_(g, 1 - c.beta1);
      v.mul_(c.beta2).addcmul_(g, g, 1 - c.beta2);
      p.mul_(c.decay).addcdiv_(m, (v / c.bc2).sqrt_().add_(c.eps), -c.step);
    }
    benchmark::DoNotOptimize(p.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kParameters);
}

void BM_FusedEma(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  Tensor avg = torch::randn({kParameters}), p = torch::randn({kParameters});
  for (auto _ : state) {
    if (!isa.empty()) DEW_CHECK(dew::nn::fused_ema_update(avg, p, 0.999), "fused ema did not apply");
    else avg.mul_(0.999).add_(p, 0.001);
    benchmark::DoNotOptimize(avg.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kParameters);
}

// The gradient norm's sum of squares (accumulated in double) against ATen's.
void BM_FusedSumOfSquares(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  Tensor g = torch::randn({kParameters});
  for (auto _ : state) {
    double s = !isa.empty() ? dew::nn::sum_of_squares(g) : g.to(at::kDouble).pow(2).sum().item<double>();
    benchmark::DoNotOptimize(s);
  }
  state.SetItemsProcessed(state.iterations() * kParameters);
}

// A 3 x 3 convolution (stride 1, padding 1) of 32 channels-last images: oneDNN's direct convolution
// through at::conv2d ("aten") against conv3x3_winograd, as dew::nn::conv() would choose between them.
void BM_WinogradConv(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  at::set_num_threads(static_cast<int>(state.range(0)));
  const int64_t C = state.range(1), O = state.range(2), S = state.range(3);
  const bool train = state.range(4) == 1, winograd = !isa.empty();
  torch::manual_seed(0);
  Tensor x = torch::randn({32, C, S, S}).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(train);
  Tensor w = (torch::randn({O, C, 3, 3}) * 0.05).requires_grad_(train), b = torch::zeros({O}).requires_grad_(train);
  Tensor g = torch::randn({32, O, S, S}).contiguous(at::MemoryFormat::ChannelsLast);
  for (auto _ : state) {
    Tensor y = winograd ? dew::nn::conv3x3_winograd(x, w, b) : at::conv2d(x, w, b, 1, 1);
    if (train) {
      y.backward(g);
      for (Tensor* t : {&x, &w, &b}) t->mutable_grad().reset();
    }
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * 32 * S * S);
}

// Each fused benchmark for ATen ("aten", isa "") and every ISA.
#define DEW_FUSED_ISAS(fn, args)                                                            \
  BENCHMARK_CAPTURE(fn, aten, std::string()) args->Unit(benchmark::kMillisecond);           \
  BENCHMARK_CAPTURE(fn, avx512, std::string("avx512")) args->Unit(benchmark::kMillisecond); \
  BENCHMARK_CAPTURE(fn, avx2, std::string("avx2")) args->Unit(benchmark::kMillisecond);     \
  BENCHMARK_CAPTURE(fn, base, std::string("base")) args->Unit(benchmark::kMillisecond)

#define DEW_THREADS ->Arg(1)->Arg(2)
DEW_FUSED_ISAS(BM_FusedAttention, ->Args({1, 49, 32})
                                      ->Args({2, 49, 32})
                                      ->Args({1, 128, 16})
                                      ->Args({2, 128, 16})
                                      ->Args({1, 196, 16})
                                      ->Args({2, 196, 16})
                                      ->Args({2, 512, 64})
                                      ->Args({2, 256, 128}));
DEW_FUSED_ISAS(BM_FusedGeluTanh, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedGroupNormSiluNchw, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedGroupNormSiluChannelsLast, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedChannelShift, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedAdamW, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedEma, DEW_THREADS);
DEW_FUSED_ISAS(BM_FusedSumOfSquares, DEW_THREADS);
// unet's 3 x 3 convolutions: 32 -> 32 at 28 x 28, 64 -> 64 and 128 -> 64 at 14 x 14, 96 -> 32 at 28 x 28.
DEW_FUSED_ISAS(BM_WinogradConv, ->ArgsProduct({{1, 2}, {32}, {32}, {28}, {0, 1}})
                                    ->ArgsProduct({{1, 2}, {64}, {64}, {14}, {0, 1}})
                                    ->ArgsProduct({{2}, {128}, {64}, {14}, {1}})
                                    ->ArgsProduct({{2}, {96}, {32}, {28}, {1}}));
DEW_FUSED_ISAS(BM_FusedRmsNorm, ->Args({1, 0})->Args({2, 0})->Args({1, 1})->Args({2, 1}));
DEW_FUSED_ISAS(BM_FusedRope, DEW_THREADS);
BENCHMARK_CAPTURE(BM_FewRowsLinear, aten, false) DEW_THREADS->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_FewRowsLinear, dew, true) DEW_THREADS->Unit(benchmark::kMicrosecond);

}  // namespace
