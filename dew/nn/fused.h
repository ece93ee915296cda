// Fused CPU kernels with hand-written backward passes for the element-wise work that dominates the
// small-model training step on CPU, and one-pass optimizer updates (Adam(W), EMA, gradient norm).
//
//   Tensor y = dew::nn::gelu_tanh(x);                                   // == at::gelu(x, "tanh")
//   Tensor z = dew::nn::group_norm_silu(x, 8, gamma, beta, 1e-5);       // == silu(group_norm(x))
//
// Why: LibTorch 1.13 as Debian ships it runs GELU-tanh's forward and backward through scalar libm tanh
// (about 16 ns per element; a third of a DiT training step), and GroupNorm followed by SiLU reads and
// writes the activation four times and keeps two copies of it for backward. These kernels vectorise with
// the widest ISA the CPU has (AVX-512, AVX2 or SSE, chosen at load time), read each tensor once per pass
// and save only the input (plus per-group statistics) for backward.
//
// They apply to float32 tensors on the CPU; anything else (another dtype or device, or a second-order
// gradient) takes the ATen composite, so callers use them unconditionally. The gradients are first-order
// only: the backward is not itself differentiable.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>

#include <string>

namespace dew::nn {

using at::Tensor;

/// GELU with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as
/// x sigmoid(2u). Matches at::gelu(x, "tanh") to float rounding (|diff| < 1e-6 |x|).
Tensor gelu_tanh(const Tensor& x);

/// silu(group_norm(x + shift, groups, weight, bias, eps)) for x: [B, C, *] (any layout; channels-last
/// tensors stay channels-last). weight and bias: [C] (both defined: the affine GroupNorm). shift, when
/// defined: [B, C], added to every position of its (sample, channel) before normalising (a ResBlock's
/// time embedding), with its gradient summed in the same pass, so the sum x + shift is never stored.
Tensor group_norm_silu(const Tensor& x, int64_t groups, const Tensor& weight, const Tensor& bias, double eps,
                       const Tensor& shift = Tensor());
/// x + shift with shift: [B, C] broadcast over x's positions ([B, C, 1, ...]); x itself when shift is
/// undefined or empty. dew::Error (via check_channel_shift) for any other shape.
Tensor add_channel_shift(const Tensor& x, const Tensor& shift);
void check_channel_shift(const Tensor& x, const Tensor& shift);
/// {group_norm_silu(x, ...), x} (on the SSE2-only variant, NCHW-contiguous x takes the composite: the
/// kernel is measured slower there; channels-last keeps the kernel): x passed through as a second output whose gradient (a residual block's
/// skip path) the fused backward adds into dx in its last pass, saving the separate add autograd would
/// otherwise run to accumulate x's two gradients. Use the second output, not x, on the skip path.
std::array<Tensor, 2> group_norm_silu_and_input(const Tensor& x, int64_t groups, const Tensor& weight,
                                                const Tensor& bias, double eps, const Tensor& shift = Tensor());

/// RMSNorm over the last dimension: x rsqrt(mean(x^2) + eps) (weight + offset), computed in float32 and
/// returned in x's dtype; weight: [D]. One pass forward and one backward (saving x and the per-row
/// 1 / rms) for float32 CPU tensors; the ATen composite otherwise.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, double offset = 0.0);

/// Rotate-half RoPE, x cos + rotate_half(x) sin, for x: [B, H, S, D] (D even) and tables [S, D] or
/// [B, 1, S, D] (dew::nn::rope_1d's). One pass each way for float32 CPU x with a contiguous last dimension
/// and tables that need no gradient; the ATen composite otherwise. The output has x's layout.
Tensor rope_rotate(const Tensor& x, const Tensor& cos, const Tensor& sin);

/// softmax(q k^T / sqrt(D)) v without a mask, for float32 CPU q: [B, H, Sq, D], k, v: [B, H, Sk, D] (check
/// fused_attention_applies; dew::Error otherwise). One pass per (batch, head) over rows that may be strided
/// views (the heads of a fused qkv projection); the output is [B, H, Sq, D] laid out as [B, Sq, H, D], so
/// merging the heads back is free. Saves the probabilities, as the composite does.
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v);
bool fused_attention_applies(const Tensor& q, const Tensor& k, const Tensor& v);
/// Whether attention() should take the fused kernel for `keys` keys where it applies: up to
/// kFusedAttentionMaxKeys, on every instruction set (docs/benchmarks.md).
bool fused_attention_preferred(int64_t keys);
/// The most keys attention() gives the fused kernel: measured faster than at::scaled_dot_product_attention
/// of LibTorch 2.13 at 49 to 196 keys (heads of 16 and 32) and slower at 256 (heads of 128) and 512 (heads of
/// 64) keys, forward + backward on the AVX2 Zen 3 (build/dew_microbench --benchmark_filter=Attention).
constexpr int64_t kFusedAttentionMaxKeys = 196;

/// at::linear(x, weight, bias) (x: [..., K], weight: [N, K]), except that float32 CPU input with at most 4
/// rows (a decoding step) runs one GEMV per row, with or without autograd. (Until LibTorch 1.13 with
/// OpenBLAS, larger inputs had their rows split over the intra-op threads, one single-threaded GEMM each;
/// against the wheel's oneMKL, which threads its own GEMMs, that split measured slower: 6.88 against
/// 4.95 ms at 1568 x 128 -> 512 on 2 threads, docs/benchmarks.md, so it was removed.)
Tensor row_parallel_linear(const Tensor& x, const Tensor& weight, const Tensor& bias);

/// Coefficients of one Adam(W) update (dew/training/optim.cpp): g' = g + l2 p, m = beta1 m + (1 - beta1) g',
/// v = beta2 v + (1 - beta2) g'^2, p = decay p - step m / (sqrt(v / bc2) + eps). AdamW: l2 = 0,
/// decay = 1 - lr wd; Adam with L2 decay: decay = 1; step = lr / bc1.
struct AdamCoefficients {
  double l2 = 0, beta1 = 0.9, beta2 = 0.999, decay = 1, step = 0, bc2 = 1, eps = 1e-8;
};
/// The update above in one pass over p, g, m, v (in place on p, m, v) when all four are contiguous float32
/// CPU tensors of one size; returns false, changing nothing, otherwise (the caller then uses ATen ops).
bool fused_adam_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamCoefficients& c);
/// avg = decay avg + (1 - decay) p in one pass, under the same conditions; false otherwise.
bool fused_ema_update(const Tensor& avg, const Tensor& p, double decay);
/// sum(x^2) accumulated in double; one pass for a contiguous float32 CPU tensor, ATen otherwise.
double sum_of_squares(const Tensor& x);
/// Whether the fused kernels run for this tensor (float32, CPU); otherwise the functions above fall back
/// to the ATen composite.
bool fused_kernels_apply(const Tensor& x);

/// The instruction set the kernels run with: "avx512", "avx2" (with FMA) or "base" (SSE2): the widest this
/// CPU supports, or the environment's DEW_FUSED_ISA (e.g. avx2 on an AVX-512 machine, to measure what an
/// AVX2 one runs), unless set_fused_kernel_isa chose another.
std::string fused_kernel_isa();
/// Runs the kernels compiled for `isa` from now on (tests compare the variants); dew::Error for a name
/// other than avx512, avx2, base, or one this CPU lacks.
void set_fused_kernel_isa(const std::string& isa);

}  // namespace dew::nn
