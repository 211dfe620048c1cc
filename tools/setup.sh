#!/usr/bin/env bash
# Set up burstfs on a fresh Debian/Ubuntu machine: system packages, a venv in
# .venv with the project (editable), its test extras and the pinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch is an optional extra of the package; the pinned CPU build is for tests and the demo.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test,torch]'
echo "burstfs is set up in $(pwd)/.venv"
