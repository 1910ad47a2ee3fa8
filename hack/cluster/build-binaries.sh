#!/usr/bin/env bash
# Builds the local cluster's binaries once and caches them outside the repository: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, and the real node's kubelet and kube-proxy
# (tools/go.mod), kwok, helm, CoreDNS (the cluster DNS the real node's pods use), and Prometheus (the
# end-to-end tests scrape a job's pods with it, with the chart's scrape configuration), and Kueue's
# controller with its CRDs (the tests of jobs that Kueue admits run it against the local cluster).
# Prints the directory that holds them. KUBEBUILDER_ASSETS, when set, is used as it is.
#
# Usage: build-binaries.sh [NAME...] builds the named binaries (every one without a name) that are
# missing. Several may run at once (`make -j test` builds CoreDNS for the node's image while this
# builds the rest): each binary is built under a lock of its own, and whoever comes second finds it.
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
# in a folder of this run's own, removed at the end, not in the caches of the machine's user.
gowork=$(mktemp -d "$cache/go-work.XXXXXX")
export GOCACHE=$gowork/build GOMODCACHE=$gowork/mod
trap '{ chmod -R u+w "$gowork"; rm -rf "$gowork"; } 2>/dev/null || true' EXIT
only=" $* "
[[ $only != *" kueue "* ]] || only="$only kueue-crds "  # its CRDs come with it

# Whether to build $1 now: named (or no name given) and missing. Holds its lock (fd 9) from here
# until the next call, so that a second run building the same binary waits and then skips it.
wanted() {
  [ "$only" = "  " ] || [[ $only == *" $1 "* ]] || return 1
  exec 9>"$out/.$1.lock" && flock 9
  [ ! -x "$out/$1" ] || return 1
  echo "building $1 (once; cached in $out)" >&2
}

build() {  # name, package, ldflags
  wanted "$1" || return 0
  go build -trimpath -ldflags "-s -w $3" -o "$out/$1.tmp" "$2" && mv "$out/$1.tmp" "$out/$1"
}

# Those without replace directives are built as released, with `go install pkg@version`.
install() {  # name, package@version, ldflags[, build tags]
  wanted "$1" || return 0
  GOBIN=$out GOFLAGS= go install -trimpath -tags "${4:-}" -ldflags "-s -w $3" "$2"
}

# CoreDNS first: the node's image build waits for it (`make test` runs both side by side). Static,
# because it runs in an image that holds nothing else.
CGO_ENABLED=0 install coredns github.com/coredns/coredns@$COREDNS_VERSION ""
ver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=34 -X k8s.io/component-base/version.gitTreeState=clean"
ver="$ver -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=34"
cd "$here/tools"
build etcd ./etcd ""
for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  build "$c" "k8s.io/kubernetes/cmd/$c" "$ver"
done
install kwok sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
install helm helm.sh/helm/v3/cmd/helm@$HELM_VERSION "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
# With the one service discovery the chart's scrape configuration uses (its build tags leave out the
# cloud providers' SDKs, most of its build).
install prometheus github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION "" remove_all_sd,enable_kubernetes_sd
install kueue sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
if wanted kueue-crds; then  # the CRDs of the same release, from its module
  mod=$(GOFLAGS= go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  mkdir -p "$out/kueue-crds.tmp" && cp "$mod"/config/components/crd/bases/*.yaml "$out/kueue-crds.tmp/"
  mv "$out/kueue-crds.tmp" "$out/kueue-crds"
fi
echo "$out"
