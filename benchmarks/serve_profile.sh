#!/usr/bin/env bash
# Where `legato serve` spends the CPU under serve_compare.sh's load: the server process (HTTP,
# SSE, engine loop, detokenizer) against its worker (the model), and optionally where the
# worker's time goes, by py-spy.
#
# usage: benchmarks/serve_profile.sh [NPROMPTS] [CONCURRENCY] [SPY_HZ] [legato serve args...]
#   NPROMPTS 64, CONCURRENCY 32; SPY_HZ 0 = no py-spy (pip install py-spy into .venv first;
#   keep it at 10 or below: sampling faster takes a core's share from a 2-core machine).
# Drives the default model in fp32 (benchmarks/fp32_model_dir.py's directory, written once; MODEL_DIR
# names another) with vLLM's own client, exactly as
# ../shared/anchors/vllm-cpu/serve_compare.sh does (random 256-token prompts, 128 out, EOS
# ignored; that script's setup.sh must have run once). Prints the client's summary lines,
# then wall seconds and each process's CPU seconds (the wall includes the client's start-up,
# about 10 s: divide by the client's "Benchmark duration" instead), the worker's step timeline
# summed by benchmarks/serve_timeline.py (idle waits, compute wall and CPU per step kind), and
# with py-spy, the worker's hottest frames.
# A figure, never asserted; run it alone (flock -x /tmp/legato-cpu.lock on the shared machine).
set -uo pipefail
n=${1:-64}; c=${2:-32}; hz=${3:-0}; shift $(( $# < 3 ? $# : 3 ))
root=$(cd "$(dirname "$0")/.." && pwd)
anchors=${ANCHOR_HOME:-$HOME/.cache/legato-anchors}
vpy=$anchors/vllm/bin/python
cli=${VLLM_CLI:-$root/../shared/anchors/vllm-cpu/vllm_cli.py}
model=${MODEL_DIR:-$("$root/.venv/bin/python" "$root/benchmarks/fp32_model_dir.py")}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
out=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
LEGATO_STEP_TIMELINE=$out/timeline.tsv setsid "$root/.venv/bin/legato" serve "$model" --dtype float32 --port "$port" --ws-port 0 \
  --served-model-name m --max-model-len 2048 --disable-log-requests "$@" >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break; sleep 1; done
worker=$(pgrep -P "$pid" | head -1)
cpu() { awk '{printf "%.1f", ($14 + $15) / 100}' "/proc/$1/stat"; }
s0=$(cpu "$pid"); w0=$(cpu "$worker"); t0=$(date +%s.%N)
spy=""
if [[ $hz != 0 ]]; then
  "$root/.venv/bin/py-spy" record -r "$hz" -d 600 -f raw -o "$out/worker.txt" -p "$worker" --nonblocking >/dev/null 2>&1 &
  spy=$!
fi
"$vpy" "$cli" bench serve --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
  --model m --tokenizer "$model" --dataset-name random --random-input-len 256 --random-output-len 128 \
  --num-prompts "$n" --max-concurrency "$c" --ignore-eos 2>&1 \
  | grep -E "Benchmark duration|Output token throughput|Median TTFT|Median TPOT|Median ITL|Failed requests"
s1=$(cpu "$pid"); w1=$(cpu "$worker"); t1=$(date +%s.%N)
echo "wall $(echo "$t1 - $t0" | bc) s (client start-up included); CPU s: server $(echo "$s1 - $s0" | bc), worker $(echo "$w1 - $w0" | bc)"
[[ -n $spy ]] && { kill -INT "$spy" 2>/dev/null; wait "$spy" 2>/dev/null; }
kill -INT -- -"$pid" 2>/dev/null; sleep 4; kill -KILL -- -"$pid" 2>/dev/null
[[ -s $out/timeline.tsv ]] && "$root/.venv/bin/python" "$root/benchmarks/serve_timeline.py" "$out/timeline.tsv"
if [[ -f $out/worker.txt ]]; then
  python3 - "$out/worker.txt" <<'PY'
import collections, sys
own, incl, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    frames, count = stack.split(";"), int(count)
    total += count
    own[frames[-1]] += count
    for frame in set(frames):
        incl[frame] += count
print(f"worker: {total} samples; hottest frames (own share, then inclusive share)")
for frame, count in own.most_common(12):
    print(f"  {100 * count / total:5.1f}%  {frame[:110]}")
for frame, count in incl.most_common(40)[8:28]:
    print(f"  {100 * count / total:5.1f}%  (incl) {frame[:110]}")
PY
fi
rm -rf "$out"
