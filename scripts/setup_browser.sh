#!/usr/bin/env bash
# The dashboard tests drive Debian's Chromium (/usr/bin/chromium) through Playwright;
# Playwright's own browser download is not used (no hub downloads on these machines).
set -euo pipefail
CHROMIUM="${VLAB_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing Debian's chromium for the dashboard tests ..."
$SUDO apt-get update -qq >/dev/null 2>&1 || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
"$CHROMIUM" --version
