#!/usr/bin/env bash
# Install Prometheus and promtool from Debian's `prometheus` package, for the alert-rule and
# scrape tests. Idempotent: does nothing when both are on PATH. Where apt-get cannot be used
# (not root, not Debian), it says so and exits 0: those tests then skip with that reason.
set -uo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-prometheus: no apt-get here; install Prometheus >= 2.42 by hand" >&2
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-prometheus: not root; run 'sudo apt-get install prometheus'" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
# A stale or empty package list makes the first try fail; refresh it once and retry.
if ! install; then
    apt-get update -q >/dev/null && install || {
        echo "install-prometheus: apt-get could not install prometheus" >&2
        exit 0
    }
fi
echo "install-prometheus: $(prometheus --version 2>&1 | head -n 1)"
