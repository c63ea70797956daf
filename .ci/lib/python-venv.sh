# Sourced by CI steps that need Python tools from PyPI.
#
#   python_venv DIR REQUIREMENTS   creates (or reuses) a virtualenv in DIR
#                                  holding exactly the pinned REQUIREMENTS;
#                                  it is rebuilt when that file changes.

python_venv() {
  local dir=$1 requirements=$2
  if [ -f "$dir/.requirements" ] && cmp -s "$requirements" "$dir/.requirements"; then
    return 0
  fi
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$dir/.requirements"
}
