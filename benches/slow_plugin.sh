#!/usr/bin/env bash
# What one slow sampler costs the rows sharing its batch (benches/slow_plugin.py), from the repo root.
cd "$(dirname "$0")/.." && exec python3 benches/slow_plugin.py "$@"
