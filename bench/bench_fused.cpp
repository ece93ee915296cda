// Micro-benchmarks of the fused CPU kernels (dew/nn/fused.h) against the ATen ops they replace, forward
// plus backward, at the shapes of `dew bench`'s models: simple_dit's MLP activation (batch 32 x 49
// tokens x 512) and the demo unet's GroupNorm + SiLU (32 x 32 x 28 x 28, 8 groups), NCHW and channels-last.
//   build/dew_microbench --benchmark_filter=Fused
#include <benchmark/benchmark.h>

#include <torch/torch.h>

#include "dew/nn/attention.h"
#include "dew/nn/fused.h"

namespace {

using at::Tensor;

void run_step(benchmark::State& state, const Tensor& x0, const std::function<Tensor(const Tensor&)>& f) {
  Tensor x = x0.clone().requires_grad_();
  Tensor g = torch::randn_like(x0);
  for (auto _ : state) {
    Tensor y = f(x);
    y.backward(g);
    x.mutable_grad().reset();
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * x0.numel());
}

void BM_FusedGeluTanh(benchmark::State& state, bool fused) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  run_step(state, torch::randn({32 * 49, 512}),
           [fused](const Tensor& x) { return fused ? dew::nn::gelu_tanh(x) : at::gelu(x, "tanh"); });
}

void BM_FusedGroupNormSilu(benchmark::State& state, bool fused, bool channels_last) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  Tensor x = torch::randn({32, 32, 28, 28});
  if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  Tensor w = torch::ones({32}).requires_grad_(), b = torch::zeros({32}).requires_grad_();
  run_step(state, x, [=](const Tensor& in) {
    return fused ? dew::nn::group_norm_silu(in, 8, w, b, 1e-5) : at::silu(at::group_norm(in, 8, w, b, 1e-5));
  });
}

// softmax(q k^T / sqrt(D)) v, forward + backward for q, k, v: simple_dit's 32 x 4 heads x 49 tokens x 32
// and the most keys it takes, 128 (head 16).
void BM_FusedAttention(benchmark::State& state, bool fused) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  const int64_t S = state.range(1), D = state.range(2);
  torch::manual_seed(0);
  Tensor qkv = torch::randn({32, S, 3, 4, D}).requires_grad_();
  Tensor g = torch::randn({32, 4, S, D});
  for (auto _ : state) {
    auto t = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
    Tensor o = fused ? dew::nn::fused_attention(t[0], t[1], t[2]) : dew::nn::attention(t[0], t[1], t[2], {}, "reference");
    o.backward(g);
    qkv.mutable_grad().reset();
    benchmark::DoNotOptimize(o.data_ptr());
  }
}

BENCHMARK_CAPTURE(BM_FusedAttention, reference, false)->Args({1, 49, 32})->Args({2, 49, 32})->Args({1, 128, 16})->Args({2, 128, 16})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedAttention, dew, true)->Args({1, 49, 32})->Args({2, 49, 32})->Args({1, 128, 16})->Args({2, 128, 16})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGeluTanh, aten, false)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGeluTanh, dew, true)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGroupNormSilu, aten_nchw, false, false)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGroupNormSilu, dew_nchw, true, false)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGroupNormSilu, aten_nhwc, false, true)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_FusedGroupNormSilu, dew_nhwc, true, true)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);

}  // namespace
