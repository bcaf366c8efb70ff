#!/usr/bin/env sh
# Prints the path of a Python >= 3.12 interpreter, or fails with one clear line.
# Looks at $PYTHON, the usual names on PATH, then pyenv/uv/conda installs; 3.12 first, as on
# the GPU image, then newer.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in "${PYTHON:-}" python3.12 python3.13 python3.14 python3 python; do
  [ -n "$cand" ] || continue
  path=$(command -v "$cand" 2>/dev/null) || continue
  if ok "$path"; then echo "$path"; exit 0; fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for path in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 "$HOME"/.local/share/uv/python/*3.1[2-9]*/bin/python3 \
              /opt/conda/bin/python3 /usr/local/bin/python3.1[2-9] 2>/dev/null | sort -V); do
  if ok "$path"; then echo "$path"; exit 0; fi
done
echo "error: no Python >= 3.12 found; install one (e.g. 'pyenv install 3.12') or run 'make PYTHON=/path/to/python3.12 ...'" >&2
exit 1
