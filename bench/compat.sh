#!/usr/bin/env bash
# trainguard's private-torch paths on another torch release than CI's pin (2.13): a venv with
# torch==$TORCH_VERSION and this checkout (editable), then the tests that cover every
# torch_compat path, the Flight Recorder probe, hang detection end to end, rendezvous, restarts
# and torchrun conformance. Prints the torch version and pytest's summary; exits with pytest's code.
#
#   bash bench/compat.sh [VENV]        # VENV, else $TRAINGUARD_COMPAT_VENV, else .venv-torch<version>
#   TORCH_VERSION=2.14.1 bash bench/compat.sh /work/venv-torch214
#
# A venv that already has the asked torch and trainguard is reused (nothing installed). The test
# extra is installed with torch pinned as a constraint, so no test dependency can swap torch.
# About 5-10 minutes on 2 cores once the venv exists.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_version="${TORCH_VERSION:-2.14.1}"
venv="${1:-${TRAINGUARD_COMPAT_VENV:-$repo/.venv-torch${torch_version//./}}}"
python="${PYTHON:-python3}"

# Every torch_compat path (test_torch_compat), the Flight Recorder dump format and its worker
# server (test_flight_recorder), hang verdicts on real jobs (test_hang_e2e), single- and
# multi-node runs, restarts and rendezvous (test_core_run, test_restart_count_env,
# test_node_names), the pre-started workers (test_zygote), launch failures, and torchrun's
# observable behaviour (test_torchrun_conformance).
TESTS=(
  tests/test_torch_compat.py
  tests/test_flight_recorder.py
  tests/test_hang_e2e.py
  tests/test_core_run.py
  tests/test_restart_count_env.py
  tests/test_node_names.py
  tests/test_zygote.py
  tests/test_launch_failures.py
  tests/test_torchrun_conformance.py
)

has_torch() {
  [[ -x "$venv/bin/python" ]] || return 1
  local got
  got="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" || return 1
  [[ "$got" == "$torch_version" ]]
}

has_trainguard() {
  "$venv/bin/python" - "$repo/src" <<'EOF' 2>/dev/null
import os, sys, trainguard, pytest
sys.exit(0 if os.path.realpath(os.path.dirname(trainguard.__file__)).startswith(os.path.realpath(sys.argv[1])) else 1)
EOF
}

if ! has_torch; then
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_version"
fi
if ! has_trainguard; then
  pin="$(mktemp)"
  trap 'rm -f "$pin"' EXIT
  echo "torch==$torch_version" >"$pin"
  "$venv/bin/pip" install -q -c "$pin" -e "$repo[test]"
fi
has_torch || { echo "compat: $venv does not hold torch $torch_version after the install" >&2; exit 2; }

cd "$repo"
export PYTHONPATH="$repo/src"
echo "compat: $(date -u +%Y-%m-%dT%H:%MZ) venv $venv"
"$venv/bin/python" -c 'import sys, torch; print(f"compat: torch {torch.__version__}, python {sys.version.split()[0]}")'
for t in "${TESTS[@]}"; do
  [[ -f "$t" ]] || { echo "compat: $t is missing" >&2; exit 2; }
done
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rfE "${TESTS[@]}" || status=$?
exit "$status"
