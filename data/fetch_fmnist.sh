#!/usr/bin/env bash
# Puts the four Fashion-MNIST idx files into DEST (default data/fashion-mnist), from Debian's
# `dataset-fashion-mnist` package (installed files under /usr/share/datasets/fashion-mnist).
# As root it installs the package; otherwise it extracts the .deb with `apt-get download` + `dpkg -x`.
# A directory you already have can be used instead: pass it as DEST (nothing is fetched if the files are there).
set -euo pipefail
dest=${1:-data/fashion-mnist}
files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
have() { local f; for f in "${files[@]}"; do [ -s "$1/$f" ] || return 1; done; }
have "$dest" && exit 0
sys=/usr/share/datasets/fashion-mnist
if ! have "$sys" && [ "$(id -u)" = 0 ]; then
  echo "fetch_fmnist: installing Debian package dataset-fashion-mnist (about 31 MB)" >&2
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  fi
fi
mkdir -p "$dest"
if have "$sys"; then
  for f in "${files[@]}"; do cp "$sys/$f" "$dest/$f"; done
else
  echo "fetch_fmnist: extracting the .deb as a non-root user" >&2
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null && dpkg -x ./*.deb root)
  for f in "${files[@]}"; do cp "$tmp/root$sys/$f" "$dest/$f"; done
fi
have "$dest" || { echo "fetch_fmnist: expected ${files[*]} in $dest" >&2; exit 1; }
echo "fetch_fmnist: Fashion-MNIST idx files in $dest" >&2
