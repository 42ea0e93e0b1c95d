#!/usr/bin/env bash
# refresh_lock.sh - re-resolve requirements/lock.txt, the versions that README's install and .ci/run use.
#
# Installs disteval with its [test] extra into a new, empty virtual environment WITHOUT the lock (so pip picks
# today's newest versions allowed by pyproject.toml), then writes every installed distribution with its exact
# version (pip freeze --all, less pip itself and disteval) to requirements/lock.txt. Run the tests against the
# new lock before committing it:
#
#   bash scripts/refresh_lock.sh            # writes requirements/lock.txt (a few minutes)
#   bash .ci/run                            # a fresh venv with the new lock, then the whole suite
#
# Knobs: PYTHON (default python3.11) the interpreter of the venv; LOCK_VENV (default: a temporary folder, removed
# at the end) where the venv is made.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
venv=${LOCK_VENV:-$(mktemp -d)/venv}
trap '[ -z "${LOCK_VENV:-}" ] && rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[test]"
{
  echo "# The exact versions the tests run against (Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), Linux x86_64), resolved $(date -u +%Y-%m-%d)"
  echo "# by scripts/refresh_lock.sh from pyproject.toml's dependencies and its [test] extra. Used as pip constraints:"
  echo "#   pip install -c requirements/lock.txt -e \".[test]\""
  echo "# torch==2.14.1 also admits the CPU wheel (2.14.1+cpu); the nvidia-* pins then install nothing."
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(pip|disteval)==' | LC_ALL=C sort -f
} > requirements/lock.txt
echo "refresh_lock.sh: wrote requirements/lock.txt ($(grep -c '==' requirements/lock.txt) pins)"
