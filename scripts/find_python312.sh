#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter for .venv-019 (megatron-core 0.19.x needs it):
# $PYTHON312 if set, else python3.12 / python3.13 on PATH, else one that pyenv has installed.
# Exits 1 with the fix when there is none.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
cands=()
[ -n "${PYTHON312:-}" ] && cands+=("$PYTHON312")
cands+=(python3.12 python3.13)
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root 2>/dev/null)
  for d in "$root"/versions/3.12* "$root"/versions/3.13*; do
    [ -x "$d/bin/python" ] && cands+=("$d/bin/python")
  done
fi
for c in "${cands[@]}"; do
  if ok "$c"; then command -v "$c"; exit 0; fi
done
echo "find_python312.sh: no Python >= 3.12 found (tried: ${cands[*]}); megatron-core 0.19.x needs" \
     "one for .venv-019: install it (e.g. pyenv install 3.12) or set PYTHON312=/path/to/python3.12" >&2
exit 1
