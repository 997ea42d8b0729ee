#!/usr/bin/env bash
# Generates Python stubs (with typed .pyi) from protos/cachet/**.proto and lays
# each package where its import name lives: cachet.common.v1 under libs/, every
# cachet.<service>.v1 under services/<service>/. With --check, generates into a
# scratch tree and fails if the committed stubs differ (stale or hand-edited).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
python=${PYTHON:-"$root/.venv/bin/python"}
# Absolute: protoc runs from inside protos/.
[[ "$python" == /* ]] || python="$PWD/$python"
# protoc finds the mypy-protobuf plugins on PATH.
export PATH="$(dirname "$python"):$PATH"
check=0
[[ "${1:-}" == "--check" ]] && check=1

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mapfile -t sources < <(cd "$here" && find cachet -name '*.proto' | sort)
(cd "$here" && "$python" -m grpc_tools.protoc -I . \
  --python_out="$scratch" --mypy_out="$scratch" \
  --grpc_python_out="$scratch" --mypy_grpc_out="$scratch" "${sources[@]}" 2> >(grep -v "^Writing mypy" >&2) >/dev/null)

status=0
for generated in "$scratch"/cachet/*/v1; do
  service=$(basename "$(dirname "$generated")")
  if [[ "$service" == common ]]; then dest="$root/libs/common/v1"; else dest="$root/services/$service/v1"; fi
  touch "$generated/__init__.py"
  if ((check)); then
    if ! diff -r -q "$generated" "$dest" >/dev/null 2>&1; then
      echo "stale stubs in ${dest#"$root"/}: run 'make protos' and commit" >&2
      status=1
    fi
  else
    mkdir -p "$dest"
    rm -f "$dest"/*_pb2*.py "$dest"/*_pb2*.pyi
    cp "$generated"/* "$dest"/
  fi
done
[[ -f "$root/libs/common/__init__.py" ]] || touch "$root/libs/common/__init__.py"
exit $status
