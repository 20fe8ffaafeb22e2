#!/usr/bin/env bash
# Install the coding-agent CLIs that tests/clients/ drives against the gateway, pinned, into .clients/
# (git-ignored): Codex CLI (npm @openai/codex, a native binary in a platform package), Cline CLI
# (npm cline, a compiled binary in a platform package) and Claude Code (npm @anthropic-ai/claude-code, a
# native binary in a platform package). Needs Node >= 20 and npm. Idempotent: when the
# pinned versions are already there it returns at once. Then run: python3 -m pytest tests/clients
set -euo pipefail
cd "$(dirname "$0")/.."

CODEX_VERSION=0.171.0
CLINE_VERSION=3.0.65
CLAUDE_VERSION=2.1.332
PREFIX=.clients
BIN="$PREFIX/node_modules/.bin"
STAMP="$PREFIX/.installed"
WANT="codex=$CODEX_VERSION cline=$CLINE_VERSION claude=$CLAUDE_VERSION"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "install-clients: node and npm are required (Node >= 20)" >&2
    exit 1
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$BIN/codex" ] && [ -x "$BIN/cline" ] \
        && [ -x "$BIN/claude" ]; then
    echo "install-clients: $WANT already in $PREFIX/"
    exit 0
fi

mkdir -p "$PREFIX"
rm -f "$STAMP"
cat > "$PREFIX/package.json" <<EOF
{
  "name": "agent-harness-test-clients",
  "private": true,
  "description": "Client CLIs for tests/clients (written by scripts/install-clients.sh)",
  "dependencies": {
    "@openai/codex": "$CODEX_VERSION",
    "cline": "$CLINE_VERSION",
    "@anthropic-ai/claude-code": "$CLAUDE_VERSION"
  }
}
EOF

echo "install-clients: installing $WANT into $PREFIX/"
# No lifecycle scripts: Codex and Cline need none (cline's only caches a link to its binary), and Claude
# Code's is run by hand below. The platform binaries come as optional dependencies, so those must not be
# omitted.
npm install --prefix "$PREFIX" --ignore-scripts --include=optional --no-audit --no-fund \
    --loglevel=error --engine-strict=false

# Claude Code's postinstall puts its platform binary in place of the bin/claude.exe placeholder.
node "$PREFIX/node_modules/@anthropic-ai/claude-code/install.cjs"

codex_v="$("$BIN/codex" --version)"
cline_v="$("$BIN/cline" --version)"
claude_v="$(DISABLE_AUTOUPDATER=1 "$BIN/claude" --version)"
if [ "$codex_v" != "codex-cli $CODEX_VERSION" ] || [ "$cline_v" != "$CLINE_VERSION" ] \
        || [ "$claude_v" != "$CLAUDE_VERSION (Claude Code)" ]; then
    echo "install-clients: unexpected versions: '$codex_v', '$cline_v', '$claude_v'" >&2
    exit 1
fi
echo "$WANT" > "$STAMP"
echo "install-clients: $codex_v, cline $cline_v, claude $claude_v"
