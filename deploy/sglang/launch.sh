#!/usr/bin/env bash
# Start SGLang from a TOML file of launch flags (default: sglang.toml beside this script), with SGLang's own
# Python, which lives in an environment separate from the gateway's (see requirements.txt).
#
#   SGLANG_PYTHON=/opt/sglang/.venv/bin/python deploy/sglang/launch.sh [--dry-run] [CONFIG] [EXTRA FLAGS...]
#
# SGLANG_PYTHON defaults to python3 (right inside the lmsysorg/sglang image). Extra flags are appended to the
# file's, so they win. The script execs SGLang, so its process id is SGLang's.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${SGLANG_PYTHON:-python3}" "$here/launch.py" "$@"
