"""`memlm train --push-to-hub` and `memlm finetune --push-to-hub`, run as a user would, with the real
`huggingface_hub` client talking to a local fake Hub (tests/training/hub_server.py): CI has no network.

What the Hub receives must be the checkpoint the run saved locally (weights byte for byte, config, tokenizer, the
flat code bundle) with the memlm model card rendered for the repository, evaluation included, and it must load back.
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from tests.training.hub_server import FakeHub
from tests.training.test_cli_and_finetune import ROOT
from tests.training.test_pretrain import MODELS, SIZES, TEXT, TRAINING

TOKEN = "hf_fake_token_for_tests"
PRETRAINED, TUNED = "someone/tiny-model", "someone/tuned"
# Written beside the checkpoint, not part of what save_pretrained (and so a push) uploads: metrics, the loss curve,
# the run's settings and its lock.
LOCAL_ONLY = {"metrics.json", "loss.png", "run.json", ".lock"}


@pytest.fixture(scope="module")
def hub():
    with FakeHub(TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory) -> dict[str, Path]:
    """`memlm train` then `memlm finetune`, each with --push-to-hub; the local output folders by repository."""
    folder = tmp_path_factory.mktemp("push")
    environment = {
        **os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(folder / "huggingface"),
        "NO_PROXY": "127.0.0.1",  # the fake Hub is local, whatever proxy the machine has
    }  # fmt: skip
    (folder / "corpus.txt").write_text(TEXT)
    (folder / "tune.txt").write_text("the delta rule writes what the memory does not yet know. " * 40)
    preset = folder / "deltanet.json"
    preset.write_text(json.dumps({"model": {**MODELS["deltanet"], **SIZES}, "training": {**TRAINING, "steps": 2}}))
    # The output folders are named like the repositories, so that the local cards name the model as the Hub's do.
    outputs = {PRETRAINED: folder / "tiny-model", TUNED: folder / "tuned"}
    commands = [
        ["train", "--preset", str(preset), "--output-dir", str(outputs[PRETRAINED]), "--data",
         str(folder / "corpus.txt"), "--push-to-hub", PRETRAINED],
        ["finetune", "--model", str(outputs[PRETRAINED]), "--output-dir", str(outputs[TUNED]), "--data",
         str(folder / "tune.txt"), "--length", "32", "--steps", "2", "--eval-blocks", "4", "--batch-size", "4",
         "--push-to-hub", TUNED],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run([sys.executable, "-m", "memlm.cli", *command], env=environment, capture_output=True,
                                text=True)  # fmt: skip
        assert result.returncode == 0, (
            f"memlm {command[0]} failed:\n{result.stderr[-4000:]}\nfake Hub: {hub.unhandled}"
        )
    return outputs


def _saved_files(folder: Path) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes() for path in folder.iterdir() if path.is_file() and path.name not in LOCAL_ONLY
    }


@pytest.mark.parametrize("repo_id", [PRETRAINED, TUNED])
def test_the_hub_receives_the_saved_checkpoint_tokenizer_and_code(hub, pushed, repo_id):
    local, remote = _saved_files(pushed[repo_id]), hub.files(repo_id)
    assert sorted(remote) == sorted(local)
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
                "modeling_deltanet.py", "configuration_deltanet.py", "memlm_export.py"}  # fmt: skip
    assert expected <= set(remote)
    other = PRETRAINED if repo_id == TUNED else TUNED
    assert remote["model.safetensors"] != hub.files(other)["model.safetensors"]  # two different models were pushed
    for name in sorted(set(remote) - {"README.md"}):
        assert remote[name] == local[name], f"{name} differs from the local save"
    # One commit for the model (weights, config, code, card), one for the tokenizer, nothing else (README unchanged).
    assert [commit["summary"] for commit in hub.commits[repo_id]] == ["Upload memlm model", "Upload tokenizer"]
    assert hub.commits[repo_id][1]["paths"] == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert hub.unhandled == []


@pytest.mark.parametrize("repo_id", [PRETRAINED, TUNED])
def test_the_pushed_card_is_the_memlm_card_for_the_repository(hub, pushed, repo_id):
    remote = hub.files(repo_id)["README.md"].decode()
    local = (pushed[repo_id] / "README.md").read_text()
    # The same card, with the repository where the local one names its folder (in "How to use").
    assert str(pushed[repo_id].resolve()) in local and str(pushed[repo_id].resolve()) not in remote
    assert remote == local.replace(str(pushed[repo_id].resolve()), repo_id)
    assert (
        "<!-- generated by memlm -->" in remote and f'from_pretrained("{repo_id}", trust_remote_code=True)' in remote
    )
    assert hub.unhandled == []


def test_the_pretraining_card_on_the_hub_carries_the_measured_evaluation(hub, pushed):
    metrics = json.loads((pushed[PRETRAINED] / "metrics.json").read_text())
    card = ModelCard(hub.files(PRETRAINED)["README.md"].decode())
    bits_per_byte = metrics["eval_after"]["bits_per_byte"]
    assert f"| after training | {bits_per_byte:.3f} |" in card.content
    results = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert results == {"bits_per_byte": pytest.approx(bits_per_byte, abs=1e-4),
                       "perplexity": pytest.approx(metrics["eval_after"]["perplexity"], abs=1e-4)}  # fmt: skip
    assert card.data.model_name == PRETRAINED.split("/")[1]


@pytest.mark.parametrize("repo_id", [PRETRAINED, TUNED])
def test_the_pushed_files_load_back_to_the_same_model(hub, pushed, tmp_path, repo_id):
    for name, content in hub.files(repo_id).items():
        (tmp_path / name).write_bytes(content)
    downloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    saved = AutoModelForCausalLM.from_pretrained(pushed[repo_id]).eval()
    input_ids = torch.tensor([[5, 40, 77, 101, 33, 2, 250, 18, 64, 9]])
    with torch.no_grad():
        assert torch.equal(downloaded(input_ids).logits, saved(input_ids).logits)


def _request(url: str, body: dict | list | None = None, token: str | None = TOKEN) -> int:
    """POST (JSON, or NDJSON for a list) or GET `url`; the HTTP status."""
    data = None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, list):
        data, headers["Content-Type"] = (
            b"".join(json.dumps(line).encode() + b"\n" for line in body),
            "application/x-ndjson",
        )
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the fake Hub is local
        with opener.open(urllib.request.Request(url, data=data, headers=headers)) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_fake_hub_refuses_what_it_does_not_implement():
    with FakeHub(TOKEN) as server:
        create = {"name": "x", "organization": "someone", "type": "model"}
        assert _request(f"{server.endpoint}/api/repos/create", create, token=None) == 401
        assert _request(f"{server.endpoint}/api/repos/create", create) == 200
        assert _request(f"{server.endpoint}/api/repos/create", create) == 409  # exists: what exist_ok expects
        assert server.unhandled == []
        lfs = [{"key": "header", "value": {"summary": "s"}},
               {"key": "lfsFile", "value": {"path": "a.bin", "algo": "sha256", "oid": "0" * 64}}]  # fmt: skip
        assert _request(f"{server.endpoint}/api/models/someone/x/commit/main", lfs) == 501
        assert _request(f"{server.endpoint}/api/models/someone/x/tree/main") == 501
        assert _request(f"{server.endpoint}/api/models/someone/x/commit/dev", lfs[:1]) == 501
        assert len(server.unhandled) == 3 and server.files("someone/x") == {}
