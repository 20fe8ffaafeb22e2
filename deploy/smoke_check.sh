#!/usr/bin/env bash
# Smoke check of a GPU host: SGLang, the gateway and one LoRA adapter, end to end. Run from anywhere:
#
#   HARNESS_ADMIN_KEY=... ADAPTER_PATH=/var/lib/harness/adapters/sql/1 deploy/smoke_check.sh
#
# Steps, each printed as one line "ok STEP detail" or "FAIL STEP detail":
#   sglang-start, sglang-health    start SGLang (unless SGLANG_LAUNCH is empty) and wait for GET /health
#   gateway-start, gateway-health  start the gateway (unless GATEWAY_URL is given) and wait for GET /healthz
#   register                       POST /admin/adapters {"name", "base", "path"}
#   publish                        POST /admin/adapters/NAME/publish {"version"}: loaded into SGLang
#   sglang-lists-adapter           SGLang's GET /v1/models lists NAME@VERSION with the base as parent
#   promote                        POST /admin/adapters/NAME/promote {"version"}
#   chat-base, chat-adapter        POST /v1/chat/completions to BASE_MODEL and to BASE_MODEL:NAME
# The exit status is the number of failed steps (0: all passed). Processes it started are stopped on exit.
#
# Environment:
#   HARNESS_ADMIN_KEY  required: the gateway's admin key (also handed to a gateway this script starts)
#   ADAPTER_PATH       required: an absolute adapter folder (adapter_config.json + weights) SGLang can read
#   ADAPTER_NAME       registry name of the adapter (default: smoke)
#   BASE_MODEL         base model name (default: served_model_name from SGLang's /get_model_info)
#   SGLANG_URL         SGLang's root URL (default: http://127.0.0.1:30000)
#   SGLANG_LAUNCH      command that starts SGLang, split on spaces, no shell (default:
#                      deploy/sglang/launch.sh deploy/sglang/sglang.toml); empty: use a running SGLang
#   SGLANG_WAIT        seconds to wait for SGLang's health (default: 900; the first start downloads weights)
#   GATEWAY_URL        a running gateway's URL; unset: start one here
#   GATEWAY_CONFIG     config of the gateway started here (default: deploy/gateway.gpu.toml)
#   GATEWAY_PORT       port of the gateway started here (default: 8000)
#   GATEWAY_WAIT       seconds to wait for the gateway's health (default: 120)
#   HARNESS_BIN        the harness command, split on spaces (default: harness)
#   API_KEY            a gateway API key for the chat requests (default: the admin key)
#   CHAT_TIMEOUT       seconds one chat request may take (default: 120)
#   LOG_DIR            where the started processes write their logs (default: a new temporary folder)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${HARNESS_ADMIN_KEY:?set HARNESS_ADMIN_KEY to the gateway admin key}"
: "${ADAPTER_PATH:?set ADAPTER_PATH to an absolute adapter folder}"
ADAPTER_NAME=${ADAPTER_NAME:-smoke}
SGLANG_URL=${SGLANG_URL:-http://127.0.0.1:30000}
SGLANG_LAUNCH=${SGLANG_LAUNCH-deploy/sglang/launch.sh deploy/sglang/sglang.toml}
SGLANG_WAIT=${SGLANG_WAIT:-900}
GATEWAY_CONFIG=${GATEWAY_CONFIG:-deploy/gateway.gpu.toml}
GATEWAY_PORT=${GATEWAY_PORT:-8000}
GATEWAY_WAIT=${GATEWAY_WAIT:-120}
CHAT_TIMEOUT=${CHAT_TIMEOUT:-120}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t harness-smoke.XXXXXX)}
mkdir -p "$LOG_DIR"
export HARNESS_ADMIN_KEY

failures=0
started=()
status=000
body=

ok() { printf 'ok %s %s\n' "$1" "${2:-}"; }
fail() {
    printf 'FAIL %s %s\n' "$1" "${2:-}"
    failures=$((failures + 1))
}

cleanup() {
    local pid
    for pid in "${started[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${started[@]}"; do
        for _ in $(seq 1 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
}

finish() {
    if ((failures > 0)); then
        echo "logs: $LOG_DIR" >&2
    fi
    exit "$failures"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start NAME LOG COMMAND...: run a command in its own process group (so cleanup reaches its children).
start() {
    local name=$1 log=$2
    shift 2
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" >"$log" 2>&1 &
    else
        "$@" >"$log" 2>&1 &
    fi
    started+=("$!")
    ok "$name" "pid $! log $log"
}

# wait_healthy URL SECONDS PID: until URL answers 2xx; fails early when PID (if given) has exited.
wait_healthy() {
    local url=$1 deadline=$((SECONDS + $2)) pid=${3:-}
    while ((SECONDS < deadline)); do
        if curl -fsS -o /dev/null --max-time 5 "$url" 2>/dev/null; then
            return 0
        fi
        if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
            return 1
        fi
        sleep 1
    done
    return 1
}

# http METHOD URL [JSON]: sets $status and $body; sends $bearer (the admin key unless set).
bearer=$HARNESS_ADMIN_KEY
http() {
    local out
    out=$(mktemp)
    local args=(-sS -o "$out" -w '%{http_code}' -X "$1" "$2" --max-time "$CHAT_TIMEOUT"
        -H "Authorization: Bearer $bearer")
    if (($# >= 3)); then
        args+=(-H 'Content-Type: application/json' --data "$3")
    fi
    status=$(curl "${args[@]}" 2>/dev/null) || status=000
    body=$(cat "$out")
    rm -f "$out"
}

# jget PATH: a field of $body by dotted path (list indexes are numbers); empty when absent.
jget() {
    python3 -c '
import json, sys
try:
    value = json.loads(sys.stdin.read())
    for part in filter(None, sys.argv[1].split(".")):
        value = value[int(part)] if isinstance(value, list) else value[part]
except (ValueError, KeyError, IndexError, TypeError):
    sys.exit(0)
print(value if isinstance(value, str) else json.dumps(value))' "$1" <<<"$body"
}

# json KEY VALUE ...: a JSON object of string values.
json() {
    python3 -c 'import json, sys; a = sys.argv[1:]; print(json.dumps(dict(zip(a[::2], a[1::2]))))' "$@"
}

short() { printf '%s' "$1" | tr '\n' ' ' | cut -c1-200; }

# -- SGLang --------------------------------------------------------------------------------------------------
sglang_pid=
if [[ -n $SGLANG_LAUNCH ]]; then
    read -r -a sglang_cmd <<<"$SGLANG_LAUNCH"
    start sglang-start "$LOG_DIR/sglang.log" "${sglang_cmd[@]}"
    sglang_pid=${started[-1]}
fi
if wait_healthy "$SGLANG_URL/health" "$SGLANG_WAIT" "$sglang_pid"; then
    ok sglang-health "$SGLANG_URL"
else
    fail sglang-health "$SGLANG_URL/health did not answer 200 (log: $LOG_DIR/sglang.log)"
    finish
fi

if [[ -z ${BASE_MODEL:-} ]]; then
    http GET "$SGLANG_URL/get_model_info"
    BASE_MODEL=$(jget served_model_name)
    if [[ -z $BASE_MODEL ]]; then
        fail base-model "set BASE_MODEL: $SGLANG_URL/get_model_info answered $status $(short "$body")"
        finish
    fi
fi

# -- the gateway ---------------------------------------------------------------------------------------------
gateway_pid=
if [[ -z ${GATEWAY_URL:-} ]]; then
    GATEWAY_URL=http://127.0.0.1:$GATEWAY_PORT
    read -r -a harness_cmd <<<"${HARNESS_BIN:-harness}"
    start gateway-start "$LOG_DIR/gateway.log" "${harness_cmd[@]}" serve --config "$GATEWAY_CONFIG" \
        --port "$GATEWAY_PORT"
    gateway_pid=${started[-1]}
fi
if wait_healthy "$GATEWAY_URL/healthz" "$GATEWAY_WAIT" "$gateway_pid"; then
    ok gateway-health "$GATEWAY_URL"
else
    fail gateway-health "$GATEWAY_URL/healthz did not answer 200 (log: $LOG_DIR/gateway.log)"
    finish
fi

# -- the adapter's lifecycle ---------------------------------------------------------------------------------
http POST "$GATEWAY_URL/admin/adapters" "$(json name "$ADAPTER_NAME" base "$BASE_MODEL" path "$ADAPTER_PATH")"
version=$(jget version)
if [[ $status == 201 && $version =~ ^[0-9]+$ ]]; then
    ok register "$ADAPTER_NAME@$version base $BASE_MODEL"
else
    fail register "HTTP $status $(short "$body")"
    finish
fi

http POST "$GATEWAY_URL/admin/adapters/$ADAPTER_NAME/publish" "{\"version\": $version}"
if [[ $status == 200 ]]; then
    ok publish "$ADAPTER_NAME@$version $(short "$(jget loaded)")"
else
    fail publish "HTTP $status $(short "$body")"
fi

http GET "$SGLANG_URL/v1/models"
parent=$(python3 -c '
import json, sys
cards = json.loads(sys.stdin.read()).get("data") or []
print(next((c.get("parent") or "" for c in cards if c.get("id") == sys.argv[1]), ""))' \
    "$ADAPTER_NAME@$version" <<<"$body" 2>/dev/null || true)
if [[ $status == 200 && -n $parent ]]; then
    ok sglang-lists-adapter "$ADAPTER_NAME@$version parent $parent"
else
    fail sglang-lists-adapter "$ADAPTER_NAME@$version not in $SGLANG_URL/v1/models: HTTP $status $(short "$body")"
fi

http POST "$GATEWAY_URL/admin/adapters/$ADAPTER_NAME/promote" "{\"version\": $version}"
if [[ $status == 200 ]]; then
    ok promote "$ADAPTER_NAME@$version"
else
    fail promote "HTTP $status $(short "$body")"
fi

# -- chat ----------------------------------------------------------------------------------------------------
bearer=${API_KEY:-$HARNESS_ADMIN_KEY}
for target in "chat-base:$BASE_MODEL" "chat-adapter:$BASE_MODEL:$ADAPTER_NAME"; do
    step=${target%%:*}
    model=${target#*:}
    request=$(python3 -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}))' "$model")
    http POST "$GATEWAY_URL/v1/chat/completions" "$request"
    content=$(jget choices.0.message.content)
    if [[ $status == 200 && -n $content ]]; then
        ok "$step" "$model: $(short "$content")"
    else
        fail "$step" "$model: HTTP $status $(short "$body")"
    fi
done

finish
