#!/usr/bin/env bash
# Installs dew from a build tree into a scratch prefix, then configures, builds and runs examples/library
# against the installed package only (find_package(dew)), as another project would.
set -euo pipefail
build=$1 src=$2
work=$build/install_check
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/examples/library" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" -j 2
"$work/consumer/dew_library_example" "$work/run"
test -f "$work/run/checkpoints/step_20/model.safetensors"
test -f "$work/run/library_grid.png"
echo "consumer: built against $work/prefix and trained $work/run"
# docs/library.md shows examples/library/main.cpp verbatim.
python3 - "$src" <<'PY'
import sys
src = sys.argv[1]
doc = open(f"{src}/docs/library.md").read()
code = open(f"{src}/examples/library/main.cpp").read()
block = doc.split("```cpp\n", 1)[1].split("```", 1)[0]
sys.exit(0 if block == code else "docs/library.md: its C++ block differs from examples/library/main.cpp")
PY
echo "consumer: docs/library.md shows examples/library/main.cpp as it is"
