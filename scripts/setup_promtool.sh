#!/usr/bin/env bash
# promtool for the alert-rule tests (tests/deploy/test_alert_rules.py): the binary of
# Debian's `prometheus` package, unpacked into DEST (default .venv/bin). The package is
# downloaded and unpacked, not installed: installing it would start a Prometheus server.
set -euo pipefail
DEST="${1:-.venv/bin}"
if [ -x "$DEST/promtool" ] || command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "unpacking promtool from Debian's prometheus package into $DEST ..."
if ! (cd "$WORK" && apt-get download -qq prometheus >/dev/null 2>&1); then
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  (cd "$WORK" && apt-get download -qq prometheus >/dev/null 2>&1)
fi
dpkg-deb -x "$WORK"/prometheus_*.deb "$WORK/root"
mkdir -p "$DEST"
install -m 0755 "$WORK/root/usr/bin/promtool" "$DEST/promtool"
"$DEST/promtool" --version 2>&1 | sed -n 1p
