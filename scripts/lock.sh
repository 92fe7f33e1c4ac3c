#!/usr/bin/env bash
# Writes constraints.txt, the lock that scripts/setup.sh installs with: every package of a
# working .venv at its exact version (fedloom itself left out; torch without its "+cpu" tag,
# which pip matches either way).
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The lock: the versions \`make\` installs (scripts/setup.sh gives this file to pip as"
  echo "# constraints), for Python 3.11 on Linux x86-64 with torch's CPU wheel. Regenerate it"
  echo "# from a working .venv with: bash scripts/lock.sh"
  .venv/bin/python -m pip freeze --exclude-editable 2>/dev/null | sed -E 's/^(torch==[^+]*)\+cpu$/\1/'
} > constraints.txt
