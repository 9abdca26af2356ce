#!/usr/bin/env bash
# Hardening soak benchmark (benches/soak.py; its docstring says what it measures) with the test venv's python, from the repo root.
cd "$(dirname "$0")/.." && exec "$(./scripts/python-test-env.sh)" benches/soak.py "$@"
