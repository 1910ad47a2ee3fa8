#!/usr/bin/env bash
# Builds the local cluster's binaries once and caches them outside the repository: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, and the real node's kubelet and kube-proxy
# (tools/go.mod), kwok, helm, CoreDNS (the cluster DNS the real node's pods use), and Prometheus (the
# end-to-end tests scrape a job's pods with it, with the chart's scrape configuration), and Kueue's
# controller with its CRDs (the tests of jobs that Kueue admits run it against the local cluster).
# Prints the directory that holds them. KUBEBUILDER_ASSETS, when set, is used as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=v1.34.4
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.19.2
COREDNS_VERSION=v1.13.1
PROMETHEUS_VERSION=v0.316.0  # the version of its Go module, github.com/prometheus/prometheus
KUEUE_VERSION=v0.17.0  # sigs.k8s.io/kueue
cache=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
out=$cache/bin/k8s-$K8S_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION
mkdir -p "$out"
# Go's build and module caches for these builds (about 13 GB) serve only while they run: they live
# in a folder of their own, removed at the end, not in the caches of the machine's user.
gowork=$cache/go-work
export GOCACHE=$gowork/build GOMODCACHE=$gowork/mod
trap '[ ! -d "$gowork" ] || { chmod -R u+w "$gowork"; rm -rf "$gowork"; }' EXIT

build() {  # name, package, ldflags
  [ -x "$out/$1" ] && return 0
  echo "building $1 (once; cached in $out)" >&2
  go build -trimpath -ldflags "-s -w $3" -o "$out/$1.tmp" "$2" && mv "$out/$1.tmp" "$out/$1"
}

ver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=34 -X k8s.io/component-base/version.gitTreeState=clean"
ver="$ver -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=34"
cd "$here/tools"
build etcd ./etcd ""
for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  build "$c" "k8s.io/kubernetes/cmd/$c" "$ver"
done
# kwok and helm carry no replace directives, so `go install pkg@version` builds them as released.
install() {  # name, package@version, ldflags
  [ -x "$out/$1" ] && return 0
  echo "building $1 (once; cached in $out)" >&2
  GOBIN=$out GOFLAGS= go install -trimpath -ldflags "-s -w $3" "$2"
}
install kwok sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
install helm helm.sh/helm/v3/cmd/helm@$HELM_VERSION "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
# Static, because it runs in an image that holds nothing else.
CGO_ENABLED=0 install coredns github.com/coredns/coredns@$COREDNS_VERSION ""
install prometheus github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION ""
install kueue sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
if [ ! -d "$out/kueue-crds" ]; then  # the CRDs of the same release, from the module the build downloaded
  crds=$(GOFLAGS= go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION/config/components/crd/bases
  mkdir -p "$out/kueue-crds.tmp" && cp "$crds"/*.yaml "$out/kueue-crds.tmp/" && mv "$out/kueue-crds.tmp" "$out/kueue-crds"
fi
echo "$out"
