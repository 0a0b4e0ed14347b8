#!/usr/bin/env bash
# The default test suite in two passes (make test; .ci/run):
#   1. every default test but the `solo` ones on WORKERS pytest-xdist workers, each file on
#      one worker, files in tests/file_seconds.json's order (longest first: tests/suite_schedule.py);
#   2. the `solo` tests (TP / DP ranks that want every core) alone, after.
# Usage: PY=.venv/bin/python scripts/run_tests.sh WORKERS [pytest args...]
# Exit: the first failing pass's code; 5 when the first pass collects nothing (CI must not
# pass on an empty run); a second pass with no solo test selected is not a failure.
set -uo pipefail
PY=${PY:-.venv/bin/python}
workers=${1:?usage: run_tests.sh WORKERS [pytest args...]}
shift

"$PY" -m pytest -q --durations=25 -n "$workers" --dist loadfile --no-loadscope-reorder \
  -m "not slow and not solo" "$@" tests
parallel=$?
"$PY" -m pytest -q --durations=5 -m "solo and not slow" "$@" tests
solo=$?
[ "$solo" -eq 5 ] && solo=0

if [ "$parallel" -ne 0 ]; then exit "$parallel"; fi
exit "$solo"
