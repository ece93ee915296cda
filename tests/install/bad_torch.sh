#!/usr/bin/env bash
# Configuring dew against a missing or a 1.x LibTorch stops CMake with the message of cmake/FindDewTorch.cmake:
# what was found and what is needed.
set -euo pipefail
build=$1 src=$2
work=$build/bad_torch_check
rm -rf "$work"
mkdir -p "$work/torch113/share/cmake/Torch"
expect() {  # expect NAME NEEDLE CMAKE_ARGS...: configuring fails and the output holds NEEDLE
  local name=$1 needle=$2
  shift 2
  if out=$(cmake -S "$src" -B "$work/$name" "$@" 2>&1); then
    echo "$name: configuring succeeded"; exit 1
  fi
  # CMake wraps the message's one line; join it back before looking.
  flat=$(echo "$out" | tr -s ' \n' ' ')
  grep -qF "$needle" <<<"$flat" || { echo "$name: no \"$needle\" in:"; echo "$out"; exit 1; }
  echo "$name: refused: $needle"
}
expect nowhere "dew: Torch_DIR=/nonexistent/libtorch holds no TorchConfig.cmake; dew needs LibTorch >= 2.6" \
  -DTorch_DIR=/nonexistent/libtorch
# A LibTorch 1.13's package files, as far as the version check reads them.
printf 'set(Torch_FOUND TRUE)\n' > "$work/torch113/share/cmake/Torch/TorchConfig.cmake"
printf 'set(PACKAGE_VERSION 1.13.1)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' \
  > "$work/torch113/share/cmake/Torch/TorchConfigVersion.cmake"
expect old "dew: found LibTorch 1.13.1 at $work/torch113/share/cmake/Torch; dew needs LibTorch >= 2.6" \
  -DTorch_DIR="$work/torch113/share/cmake/Torch"
rm -rf "$work"
