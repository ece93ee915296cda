#!/usr/bin/env bash
# The golden comparisons whose float64 truths used to carry diffusers' float32 timestep sinusoid (sd3, flux,
# qwen_image), run again with oneMKL taking the vector-math kernels of an Intel CPU (mkl_intel_kernels.cc,
# preloaded): their float32 exp / sin / cos differ in the last bit from the generic kernels an AMD CPU gets, and the
# goldens must hold on either kind of CPU. Exits 77 (skipped) where oneMKL never asks (a LibTorch without oneMKL).
set -euo pipefail
tests=$1 shim=$2 work=$3
mark=$work/mkl_intel_kernels.mark
rm -f "$mark"
DEW_MKL_SHIM_MARK=$mark LD_PRELOAD=$shim "$tests" \
  --gtest_filter='Golden/ReferenceParity.*:FlowPipeline.*:SD3Transformer*:FluxTransformer*:QwenImage*'
if [[ ! -e $mark ]]; then
  echo "oneMKL never asked whether the CPU is an Intel one: the preload changed nothing here"
  exit 77
fi
echo "oneMKL took the Intel kernels (the preload answered)"
