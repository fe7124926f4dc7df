#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2 from Debian bookworm's
# `kubernetes` source package, and extract Debian's kubectl 1.20 -- once per cache directory.
#
#   scripts/cluster/build.sh            # prints the bin directory when done
#
# Result: ${XDG_CACHE_HOME:-$HOME/.cache}/tandem/k8s-v1.20.2/bin/{kube-apiserver,kube-controller-manager,
# kube-scheduler,kubectl}. Needs (as root, once): apt-get install golang-go rsync etcd-server
# golang-github-modern-go-reflect2-dev dpkg-dev.  A few minutes and 1.4 GB RAM on 2 cores.
set -euo pipefail
VERSION=v1.20.2
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/k8s-${VERSION}"
BIN="$CACHE/bin"
if [[ -x "$BIN/kube-apiserver" && -x "$BIN/kube-controller-manager" && -x "$BIN/kube-scheduler" && -x "$BIN/kubectl" ]]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [[ -x "$BIN/kube-apiserver" && -x "$BIN/kubectl" ]]; then echo "$BIN"; exit 0; fi

need() { command -v "$1" >/dev/null 2>&1; }
if ! need go || ! need etcd || ! need rsync || ! need dpkg-source || [[ ! -d /usr/share/gocode/src/github.com/modern-go/reflect2 ]]; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q golang-go rsync etcd-server \
      golang-github-modern-go-reflect2-dev dpkg-dev >&2
  else
    echo "missing build tools: apt-get install golang-go rsync etcd-server golang-github-modern-go-reflect2-dev dpkg-dev" >&2
    exit 1
  fi
fi

WORK="$CACHE/build"
rm -rf "$WORK"; mkdir -p "$WORK/apt/lists/partial" "$WORK/src"
# A private sources list holding bookworm's deb-src line for the mirror apt already uses.
MIRROR=$( { grep -h -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } \
  | grep -o -E 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -1 | tr -d ' ' || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
echo "deb-src ${MIRROR%/} bookworm main" > "$WORK/apt/sources.list"
echo "deb ${MIRROR%/} bookworm main" >> "$WORK/apt/sources.list"
APTOPT=(-o "Dir::Etc::SourceList=$WORK/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache::archives=$WORK/apt" -o "APT::Sandbox::User=root")
apt-get "${APTOPT[@]}" update -q >&2
cd "$WORK/src"
apt-get "${APTOPT[@]}" source --download-only kubernetes >&2
dpkg-source --no-check -x ./kubernetes_*.dsc tree >&2
# Debian's kubectl 1.20 (the kubernetes-client binary package), extracted rather than installed so it
# does not clash with another kubectl on the machine.
apt-get "${APTOPT[@]}" download kubernetes-client >&2
dpkg-deb -x ./kubernetes-client_*.deb "$WORK/client"

cd "$WORK/src/tree"
# Trap: vendored reflect2 1.0.1 crashes under Go 1.19 on the first custom-resource write.
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
export GO111MODULE=off CGO_ENABLED=0 KUBE_GIT_VERSION=$VERSION GOFLAGS= GOCACHE="$WORK/gocache"
# Not `make WHAT=...`: that first builds and runs every code generator (prerelease-lifecycle, deepcopy,
# defaulter, conversion, openapi, bindata) over the whole tree, though Debian's tarball already holds
# their output (468 zz_generated files) except the Kubernetes OpenAPI definitions
# (pkg/generated/openapi), which kube-apiserver and kube-controller-manager import. So: that
# generator alone, then the Go build of the three commands (bench/RESULTS.md, "Thirteenth session:
# the test command's time").
make gen_openapi >&2
hack/make-rules/build.sh cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler >&2
mkdir -p "$BIN.tmp"
for b in kube-apiserver kube-controller-manager kube-scheduler; do
  cp "$(find _output -type f -name "$b" -perm -u+x | head -1)" "$BIN.tmp/$b"
done
cp "$WORK/client/usr/bin/kubectl" "$BIN.tmp/kubectl"
rm -rf "$BIN"; mv "$BIN.tmp" "$BIN"
cd "$CACHE"; rm -rf "$WORK"
echo "$BIN"
