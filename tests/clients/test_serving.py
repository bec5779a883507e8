"""`memlm serve`, a real server: one `memlm serve` subprocess on 127.0.0.1 (started with --continuous-batching, which
memlm's models decline: serve falls back to `generate`) serves saved checkpoints of the three families, each request
naming its checkpoint; the real `openai` client drives /v1/completions, /v1/chat/completions (plain and streaming) and
/v1/responses, three requests at once, and `transformers chat` runs against it. What it answers is what the checkpoint
generates greedily in this process. Every request and the server's start are bounded in time; the server is always
stopped."""

import concurrent.futures
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.cli import main
from memlm.serving import SERVE_EXTRA_NEEDED
from memlm.tokenization import byte_level_tokenizer
from tests.clients.models import FAMILIES, tiny_model

MISSING = [name for name in SERVE_EXTRA_NEEDED if importlib.util.find_spec(name) is None]
# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = [
    pytest.mark.huggingface,
    pytest.mark.skipif(bool(MISSING), reason=f"needs the serve extra (pip install 'memlm[serve]'): no {MISSING}"),
]

ROOT = Path(__file__).resolve().parents[2]
START_SECONDS = 90  # the server's imports on a busy 2-core machine
REQUEST_SECONDS = 30
NEW_TOKENS = 6
PROMPT = "the memory"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint of each family that writes only lowercase letters (tests/clients/models.py), and one built as the
    README shows whose LM head always picks <|endoftext|>: each saved with the byte-level tokenizer."""
    folder = tmp_path_factory.mktemp("served")
    tokenizer = byte_level_tokenizer()
    models = {family: tiny_model(family, tokenizer) for family in FAMILIES}
    torch.manual_seed(0)
    models["ends"] = DeltaNetForCausalLM(DeltaNetConfig.from_preset(
        "paper", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        lm_head_bias=True,
    ))  # fmt: skip
    with torch.no_grad():
        models["ends"].lm_head.bias[tokenizer.eos_token_id] = 1e4
    for name, model in models.items():
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return {name: folder / name for name in models}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`memlm serve` with no checkpoint of its own (each request names one), started at once (it imports while the
    checkpoints are built) and stopped when the module's tests are done. Yields its URL and how to wait for it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "memlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--continuous-batching"]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()

    def wait_until_up():
        while not _healthy(url):
            assert process.poll() is None, f"memlm serve exited ({process.returncode}):\n{log_path.read_text()}"
            assert time.monotonic() < started + START_SECONDS, (
                f"memlm serve not up in {START_SECONDS} s:\n{log_path.read_text()}"
            )
            time.sleep(0.2)

    try:
        yield url, wait_until_up
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def client(server, checkpoints):
    """The `openai` client of the server, once it is up."""
    import openai

    url, wait_until_up = server
    wait_until_up()
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)


def _greedy(folder: Path, chat: bool = False) -> str:
    """What the saved checkpoint generates greedily in this process from PROMPT, or from MESSAGES through its chat
    template."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if chat:
        input_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True).input_ids  # fmt: skip
    else:
        input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_completions_chat_and_responses_answer_what_the_checkpoint_generates(client, checkpoints, family):
    model = str(checkpoints[family])
    expected = _greedy(checkpoints[family])
    assert len(expected) == NEW_TOKENS and expected.isalpha()
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == NEW_TOKENS

    answer = _greedy(checkpoints[family], chat=True)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0)
    assert chat.choices[0].message.content == answer and chat.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True)  # fmt: skip
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(choice.delta.content or "" for choice in chunks) == answer
    assert len(chunks) > 2 and chunks[-1].finish_reason == "length"  # streamed in pieces
    # serve's /v1/responses streams unless told not to.
    response = client.responses.create(model=model, input="Hi", max_output_tokens=NEW_TOKENS, temperature=0,
                                       stream=False)  # fmt: skip
    assert response.output_text == answer and response.status == "completed"


def test_three_requests_at_once_get_what_each_gets_alone(client, checkpoints):
    def complete(family):
        return client.completions.create(model=str(checkpoints[family]), prompt=PROMPT, max_tokens=NEW_TOKENS,
                                         temperature=0).choices[0].text  # fmt: skip

    alone = [complete(family) for family in FAMILIES]
    with concurrent.futures.ThreadPoolExecutor(len(FAMILIES)) as pool:
        together = list(pool.map(complete, FAMILIES))
    assert together == alone and len(set(alone)) == len(FAMILIES)


def test_a_checkpoint_built_as_the_readme_shows_ends_its_answer_at_the_end_of_text(client, checkpoints):
    model = str(checkpoints["ends"])
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW_TOKENS)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == ""
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS)
    assert completion.choices[0].finish_reason == "stop" and completion.usage.completion_tokens == 1


def test_transformers_chat_talks_to_it(client, server, checkpoints, tmp_path):
    """`transformers chat` reads the user's lines from stdin: one message, "n" to its offer to go on past the token
    limit, then !exit. huggingface_hub's client, which it sends through, refuses every request (127.0.0.1 too) under
    HF_HUB_OFFLINE, so it runs without it; it reaches nothing but this server (no update check). `client`: the server
    is up."""
    model = str(checkpoints["deltanet"])
    environment = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    environment.update(HF_HUB_DISABLE_UPDATE_CHECK="1", HF_HUB_DISABLE_TELEMETRY="1", COLUMNS="200")
    url, _ = server
    command = [sys.executable, "-m", "transformers.cli.transformers", "chat", model, f"{url}/v1",
               f"max_new_tokens={NEW_TOKENS}", "do_sample=False"]  # fmt: skip
    result = subprocess.run(command, input="Hi\nn\n!exit\n", env=environment, cwd=tmp_path, capture_output=True,
                            text=True, timeout=START_SECONDS)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"<{model}>:" in result.stdout and f"{NEW_TOKENS} tokens in" in result.stdout
    assert _greedy(checkpoints["deltanet"], chat=True) in result.stdout


def test_a_bad_option_gets_serve_s_usage_and_a_missing_checkpoint_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--no-such-option"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Usage: memlm serve [OPTIONS]" in error and "--no-such-option" in error
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path / "missing")])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip()
    assert error == (
        f"memlm: error: the folder '{tmp_path / 'missing'}' does not exist (nor is it a Hub repository id): give a "
        "folder written by save_pretrained, with its tokenizer, or a Hub repository."
    )
