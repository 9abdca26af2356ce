"""Fixtures for the HTTP end-to-end suite: the real `mlxhost` binary serving
the real model (SmolLM2-135M-Instruct, installed by scripts/setup.sh) with
real plugins, driven with the official `openai` SDK and raw HTTP (httpx).

Environment: MLXHOST_BIN (default target/debug/mlxhost), MLXHOST_PLUGINS_DIR
(default plugins/, built by scripts/build-plugins.sh), MLXHOST_MODEL (the
binary's own default when unset).
"""

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MLXHOST_BIN", ROOT / "target" / "debug" / "mlxhost"))
PLUGINS = Path(os.environ.get("MLXHOST_PLUGINS_DIR", ROOT / "plugins"))
READY = re.compile(r"serving .* at (http://[0-9.:]+)")


class Server:
    """A running `mlxhost serve` on a free port; its stderr goes to a file."""

    def __init__(self, *args, plugins=PLUGINS, env=None, wait=True):
        self.log_path = Path(tempfile.mkstemp(prefix="mlxhost-serve-", suffix=".log")[1])
        self.log = open(self.log_path, "w")
        cmd = [str(BIN), "serve", "--port", "0", "--plugins", str(plugins), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ, **(env or {})}
        )
        self.url = None
        if wait:
            self.wait_ready()

    @staticmethod
    def default_model():
        """The model `serve` loads without --model (installed by scripts/setup.sh)."""
        cache = os.environ.get("MLXHOST_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxhost"
        )
        return Path(cache) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

    def wait_ready(self, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxhost serve exited {self.proc.returncode}:\n{self.text()}")
            m = READY.search(self.text())
            if m:
                self.url = m.group(1)
                return
            time.sleep(0.1)
        raise TimeoutError(f"mlxhost serve not ready after {timeout}s:\n{self.text()}")

    def text(self):
        return self.log_path.read_text(errors="replace")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kw)

    def http(self):
        return httpx.Client(base_url=self.url, timeout=300)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def run_binary(*args, input=None, timeout=600):
    """Runs the binary to completion (for `score`, startup failures, ...)."""
    return subprocess.run(
        [str(BIN), *args], input=input, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def server():
    """The default set-up: default model, the first-party plugins."""
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def http(server):
    with server.http() as c:
        yield c


def chat(text):
    return [{"role": "user", "content": text}]


def plugin_folder(tmp_path, *names):
    """A plugins directory with copies of the named first-party or test-only
    plugins (manifest + component), as a user would assemble one."""
    import shutil

    root = tmp_path / "plugins"
    root.mkdir()
    for name in names:
        src = next(p for p in (PLUGINS / name, PLUGINS / "testing" / name) if (p / "plugin.toml").is_file())
        dst = root / name
        dst.mkdir()
        shutil.copy(src / "plugin.toml", dst)
        for wasm in src.glob("*.wasm"):
            shutil.copy(wasm, dst)
    return root


def assert_picked_token_zero(reply):
    """The `lowest-id` sampler picks id 0, SmolLM2's `<|endoftext|>`: an end-of-generation
    token (as llama.cpp counts them), so the reply ends at once, empty, after one token,
    where greedy decoding would have answered."""
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["content"] == "", choice
    assert reply["usage"]["completion_tokens"] == 1, reply["usage"]


def steps_before_near_tie(case, near_tie):
    """Greedy steps of a llama.cpp fixture case before the first near-tie (a top-2 margin under
    `near_tie` nats in llama.cpp's teacher-forced logprobs): tokens compare equal only that far."""
    for k, step in enumerate(case["teacher_forced_top5"]):
        top = step["top5"]
        if top[0][1] - top[1][1] < near_tie:
            return k
    return len(case["teacher_forced_top5"])
