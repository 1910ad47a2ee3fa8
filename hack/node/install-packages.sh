#!/usr/bin/env bash
# Installs the Debian packages the real node and the image builds need, where any is missing:
# containerd and runc (the node's container runtime), the CNI plugins (the pod network), iptables,
# conntrack and socat (kube-proxy, the API relay), docker.io (dockerd builds the images) and
# debootstrap (their base). Needs root and Debian's archive; does nothing when all are present.
set -euo pipefail
need=()
for pair in containerd:containerd runc:runc socat:socat iptables:iptables conntrack:conntrack ip:iproute2 \
            dockerd:docker.io debootstrap:debootstrap gcc:gcc; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
[ -e /usr/lib/cni/bridge ] || [ -e /opt/cni/bin/bridge ] || need+=(containernetworking-plugins)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "the real-node tests will skip: they need these Debian packages (as root): ${need[*]}" >&2
  exit 0
fi
echo "installing ${need[*]} (once)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
