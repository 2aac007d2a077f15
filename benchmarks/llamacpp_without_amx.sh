#!/usr/bin/env bash
# The llama.cpp peer for a CPU whose AMX llama.cpp cannot use: built into its own $ANCHOR_HOME.
#
# ../shared/anchors/llama-cpp/setup.sh builds llama-cpp-python with -DGGML_NATIVE=ON. On an Intel
# Xeon that reports AMX (amx_tile, amx_int8 in /proc/cpuinfo) that compiles ggml's AMX matmul, and
# on the VMs of this kind we met, its first `ldtilecfg` faults (general protection fault in
# libggml-cpu.so, dmesg; the Python process dies with SIGSEGV, even after asking the kernel for
# the AMX state with arch_prctl), so compare.sh prints "llamacpp ... failed" for every file. This
# builds the same release with every native SIMD flag but AMX (the same `llama_print_system_info`
# flags, AMX_INT8 left out) into ANCHOR_HOME (default ~/.cache/legato-anchors-noamx), and copies
# the anchor's GGUF files there, so the anchor's scripts run against it unchanged:
#
#   benchmarks/llamacpp_without_amx.sh
#   ANCHOR_HOME=~/.cache/legato-anchors-noamx ../shared/anchors/llama-cpp/compare.sh .venv/bin/python "Q4_1 Q8_0 Q4_K_M" 2
#   ANCHOR_HOME=~/.cache/legato-anchors-noamx .venv/bin/python benchmarks/gguf_streams.py
#
# Run ../shared/anchors/llama-cpp/setup.sh (or compare.sh) once first: it makes the GGUF files.
# About 5 minutes on 2 cores; re-running is instant.
set -euo pipefail
home=${ANCHOR_HOME:-$HOME/.cache/legato-anchors-noamx}
source_home=$HOME/.cache/legato-anchors
mkdir -p "$home/gguf"
cp -n "$source_home"/gguf/*.gguf "$home/gguf/"
if [[ ! -f $home/llamacpp/.done ]]; then
  python3 -m venv "$home/llamacpp"
  "$home/llamacpp/bin/pip" install -q -U pip
  flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  flags+=" -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
  # --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS and would return the AMX build
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="$flags" \
    "$home/llamacpp/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36
  touch "$home/llamacpp/.done"
fi
"$home/llamacpp/bin/python" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())'
echo "ready: $home"
