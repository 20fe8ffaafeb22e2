#!/usr/bin/env bash
# The whole loop on one GPU, in at most 10 minutes, each stage printed with its time:
#
#   SGLANG_PYTHON=/opt/sglang/.venv/bin/python HARNESS_PYTHON=/opt/harness/.venv/bin/python deploy/gpu/check.sh
#
#   env       the GPU, CUDA torch in the harness environment, SGLang's version
#   model     the embedded model (SmolLM2-135M-Instruct) as a checkpoint folder SGLang can serve
#   sglang    SGLang serving it with LoRA enabled (deploy/sglang/launch.sh), healthy
#   gateway   the gateway in front of it (an sglang backend), healthy
#   capture   the tools suite's train demonstrations into the gateway's store
#   sft       replay-train --mode sft on CUDA (bf16 autocast): train, validate, gate, and with a pass publish
#             to the gateway, which loads the adapter into SGLang
#   served    SGLang lists the published version; a chat through the gateway to it answers
#   rl        replay-train --mode rl --gateway: one step of rollouts on SGLang through the gateway (the step's
#             adapter published there as a version first) and an update from the published adapter
# A line a stage: "ok STAGE SECONDS detail" or "FAIL STAGE SECONDS detail"; then the total against the 600 s budget.
# Exit status 0 when every stage passed within the budget. Processes it started are stopped on exit.
#
# Environments (pinned in deploy/, each its own: SGLang's CUDA torch and transformers 5 conflict with the
# gateway's):
#   SGLANG_PYTHON   python3 of an environment with deploy/sglang/requirements.txt
#   HARNESS_PYTHON  python3 of an environment with deploy/gpu/requirements.txt (CUDA torch) and then this checkout:
#                   pip install -r deploy/gpu/requirements.txt && pip install -c requirements.lock -e '.[train]'
# Optional: WORK (a folder for the store, adapters, runs and logs; default a new temporary one), SGLANG_PORT
# (30000), GATEWAY_PORT (8000), BUDGET (600).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

: "${SGLANG_PYTHON:?set SGLANG_PYTHON to the python3 of an environment with deploy/sglang/requirements.txt}"
: "${HARNESS_PYTHON:?set HARNESS_PYTHON to the python3 of an environment with deploy/gpu/requirements.txt}"
WORK=${WORK:-$(mktemp -d -t harness-gpu-check.XXXXXX)}
SGLANG_PORT=${SGLANG_PORT:-30000}
GATEWAY_PORT=${GATEWAY_PORT:-8000}
BUDGET=${BUDGET:-600}
SERVED=smollm2
mkdir -p "$WORK/adapters" "$WORK/runs"
export HARNESS_ADMIN_KEY=${HARNESS_ADMIN_KEY:-check-$RANDOM$RANDOM}
export HARNESS_STORE__PATH=$WORK/harness.db HARNESS_TRAINING__BASE_MODEL=$SERVED
export HARNESS_TRAINING__OUTPUT_DIR=$WORK/runs HARNESS_TRAINING__TASKS_DIR=$WORK/tasks
harness() { "$HARNESS_PYTHON" -m harness "$@"; }

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

began=$(date +%s)
failed=0
# stage NAME COMMAND...: run it, print its line with its seconds and the last line it printed.
stage() {
    local name=$1 start out status
    shift
    start=$(date +%s.%N)
    if out=$("$@" 2>&1); then status=ok; else status=FAIL; failed=$((failed + 1)); fi
    printf '%s %s %.1f %s\n' "$status" "$name" "$(echo "$(date +%s.%N) - $start" | bc)" \
        "$(printf '%s\n' "$out" | tail -n 1)"
    printf '%s\n' "$out" >"$WORK/$name.log"
    [[ $status == ok ]] || { echo "see $WORK/$name.log"; exit 1; }
}

wait_for() {  # URL SECONDS
    local deadline=$(($(date +%s) + $2))
    until curl -fsS -o /dev/null "$1"; do
        (($(date +%s) < deadline)) || { echo "no answer from $1 in $2 s"; return 1; }
        sleep 1
    done
    echo "$1 answers"
}

env_check() {
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    "$HARNESS_PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA in the harness environment"'
    "$SGLANG_PYTHON" -c 'import sglang; print("sglang", sglang.__version__)'
}

model_folder() {  # loading the GGUF once writes its checkpoint folder (the cache), which is what SGLang reads
    "$HARNESS_PYTHON" -c 'from gateway.backends.local.loading import cache_folder, embedded_model_file, load_model
load_model()
print(cache_folder(embedded_model_file()))' | tail -n 1 >"$WORK/model_path"
    cat "$WORK/model_path"
}

start_sglang() {
    cat >"$WORK/sglang.toml" <<EOF
model-path = "$(cat "$WORK/model_path")"
served-model-name = "$SERVED"
host = "127.0.0.1"
port = $SGLANG_PORT
enable-lora = true
max-lora-rank = 16
lora-target-modules = "all"
max-loras-per-batch = 4
max-loaded-loras = 8
EOF
    SGLANG_PYTHON=$SGLANG_PYTHON deploy/sglang/launch.sh "$WORK/sglang.toml" >"$WORK/sglang.out" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$SGLANG_PORT/health" 300
}

start_gateway() {
    cat >"$WORK/gateway.toml" <<EOF
[server]
port = $GATEWAY_PORT

[[backends]]
name = "sglang"
kind = "sglang"
base_url = "http://127.0.0.1:$SGLANG_PORT/v1"
models = ["$SERVED"]

[routing]
adapters_dir = "$WORK/adapters"
EOF
    harness serve --config "$WORK/gateway.toml" >"$WORK/gateway.out" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$GATEWAY_PORT/healthz" 120
}

served() {
    curl -fsS "http://127.0.0.1:$SGLANG_PORT/v1/models" | grep -o '"id": *"tools@[0-9]*"'
    curl -fsS "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" -H "Authorization: Bearer $HARNESS_ADMIN_KEY" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$SERVED:tools\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"What is 2 plus 2?\"}]}" \
        | grep -o '"finish_reason": *"[a-z_]*"'
}

stage env env_check
stage model model_folder
stage sglang start_sglang
stage gateway start_gateway
stage capture harness tasks capture --split train --attempts 0
export HARNESS_TRAINING__MODEL_PATH
HARNESS_TRAINING__MODEL_PATH=$(cat "$WORK/model_path")
# Exit 0: the candidate passed the gate and is published (exit 1 would be a refusal, a failed check here).
stage sft harness replay-train --mode sft --source demo --publish "http://127.0.0.1:$GATEWAY_PORT"
stage served served
# From the published adapter (the registry's active version, replay-train's default start): one step of rollouts
# on SGLang through the gateway (which takes no constrain_tool_calls) and one update; exit 1 (RL's candidate
# refused by the gate) still shows the loop ran.
stage rl bash -c 'HARNESS_TRAINING__RL__STEPS=1 HARNESS_TRAINING__RL__TASKS_PER_STEP=4 \
    HARNESS_TRAINING__CONSTRAIN_TOOL_CALLS=false "$0" -m harness replay-train --mode rl --source demo \
    --gateway "http://127.0.0.1:$1" || [[ $? == 1 ]]' "$HARNESS_PYTHON" "$GATEWAY_PORT"

total=$(($(date +%s) - began))
if ((failed == 0 && total <= BUDGET)); then
    echo "ok total $total s of $BUDGET s"
else
    echo "FAIL total $total s of $BUDGET s, $failed stage(s) failed"
    exit 1
fi
