#!/usr/bin/env bash
# Refreshes the Swagger UI files that `GET /docs` serves from inside the
# binary (assets/swagger-ui/), from the npm registry's swagger-ui-dist.
# The server never fetches them at build or run time: this script is the
# only thing that does, by hand, when the pinned version changes.
#
#   scripts/vendor-swagger-ui.sh            # the pinned version below
#   SWAGGER_UI_VERSION=5.x.y scripts/vendor-swagger-ui.sh
set -euo pipefail
cd "$(dirname "$0")/.."

version="${SWAGGER_UI_VERSION:-5.35.0}"
dest=assets/swagger-ui
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack --silent "swagger-ui-dist@$version" >/dev/null)
tar -xzf "$work"/swagger-ui-dist-*.tgz -C "$work"

mkdir -p "$dest"
for file in swagger-ui-bundle.js swagger-ui.css; do
  # Source maps are not shipped; without this line a browser's developer
  # tools would ask the server for a .map file it does not have.
  grep -v '^//# sourceMappingURL=\|^/\*# sourceMappingURL=.*\*/$' "$work/package/$file" > "$dest/$file"
done
cp "$work/package/LICENSE" "$work/package/NOTICE" "$work/package/swagger-ui-bundle.js.LICENSE.txt" "$dest/"
echo "$version" > "$dest/VERSION"
(cd "$dest" && sha256sum swagger-ui-bundle.js swagger-ui.css > SHA256SUMS)
echo "vendored swagger-ui-dist $version into $dest"
