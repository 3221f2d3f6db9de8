#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the test dependencies into .venv, then runs the linter,
# the type checker and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,examples,nixl]'
# NIXL for the nixl backend's tests, without the torch its wheel declares (host memory does not need it).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps nixl==1.5.1 nixl-cu12==1.5.1
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy
# Three processes, one test file each at a time (a file's daemons and fixtures stay in one process): the integration
# tests mostly wait on daemons, so three share two cores well (about half the serial time here).
echo "== pytest"; .venv/bin/pytest -n 3 --dist loadfile "$@"
