#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv (seeing a system torch if there is one), torch==2.13.0 where
# no torch is installed, and dtp itself in editable mode with its test extras. Fast on a second run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DTP_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    "$py" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
stamp="$venv/.dtp-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$py" -m pip install --quiet --disable-pip-version-check -e ".[test]"
    touch "$stamp"
fi
