"""`memlm kernels push` (issue 21), run as a user would, with the real `huggingface_hub` client talking to a local fake
Hub (tests/training/hub_server.py): CI has no network.

What arrives must be the generated repository, on main and on the branch `v{version}` that the `kernels` package looks
for; a re-push must leave no file of an earlier generation under `build/`; and the real `kernels` package must load
the pushed repository from the Hub and swap memlm's layers for the same logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from packaging.version import Version

import memlm
from memlm.kernel_repository import KERNEL_UPLOADS_HUB_VERSION, VARIANTS, repository_files
from tests.training.hub_server import FakeHub, repository_key

pytestmark = pytest.mark.huggingface

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_fake_token_for_tests"
PUBLISHER = "someone"  # the namespace the fake Hub calls a trusted kernel publisher, as `kernels` requires
REPOSITORY, REPUSHED = f"{PUBLISHER}/memlm-kernels", f"{PUBLISHER}/memlm-kernels-repushed"
# A file an older memlm generated and this one does not, and a file someone added beside the generated ones.
STALE, ADDED = "build/torch-cpu/memlm_kernels/memlm_old.py", "NOTES.md"
# Whether the installed huggingface_hub can commit to a kernel repository (under the oldest release allowed it cannot,
# and `push` says so: test_an_old_huggingface_hub_is_named_in_one_line).
UPLOADS = Version(huggingface_hub.__version__) >= Version(KERNEL_UPLOADS_HUB_VERSION)
needs_uploads = pytest.mark.skipif(
    not UPLOADS, reason=f"huggingface_hub {huggingface_hub.__version__} cannot commit to a kernel repository"
)


@pytest.fixture(scope="module")
def hub():
    with FakeHub(TOKEN, trusted_publishers=(PUBLISHER,)) as server:
        yield server


def _environment(hub: FakeHub, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    """The environment of a user whose Hub is the fake one (read when huggingface_hub is imported, hence the
    subprocesses): online, without Xet, a fresh cache and login folder, and `token` in HF_TOKEN."""
    environment = {
        **os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(home),
        "NO_PROXY": "127.0.0.1",  # the fake Hub is local, whatever proxy the machine has
    }  # fmt: skip
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "KERNELS_CACHE", "LOCAL_KERNELS", "MEMLM_DEBUG"):
        environment.pop(name, None)
    if token is not None:
        environment["HF_TOKEN"] = token
    return environment


def _run(command: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=environment, capture_output=True, text=True, cwd=ROOT, timeout=300)


def _memlm(*arguments: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "memlm.cli", *arguments], environment)


def _expected(version: int = 1) -> dict[str, bytes]:
    return {path: text.encode("utf-8") for path, text in repository_files(version).items()}


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory) -> subprocess.CompletedProcess:
    """`memlm kernels push REPOSITORY`, once."""
    if not UPLOADS:
        pytest.skip(f"huggingface_hub {huggingface_hub.__version__} cannot commit to a kernel repository")
    result = _memlm("kernels", "push", REPOSITORY, environment=_environment(hub, tmp_path_factory.mktemp("home")))
    assert result.returncode == 0, f"memlm kernels push failed:\n{result.stderr[-4000:]}\nfake Hub: {hub.unhandled}"
    return result


@needs_uploads
def test_push_uploads_every_generated_file_and_points_v1_at_its_commit(hub, pushed):
    key = repository_key(REPOSITORY, "kernel")
    assert hub.files(REPOSITORY, "kernel") == _expected()
    [commit] = hub.commits[key]  # one commit for the whole repository
    assert commit["paths"] == sorted(_expected())
    assert hub.branches[key] == {"v1": commit["oid"]}
    assert hub.files(REPOSITORY, "kernel", "v1") == _expected()
    assert json.loads(hub.files(REPOSITORY, "kernel")["build/torch-cpu/metadata.json"])["version"] == 1
    assert not hub.private[key]
    assert commit["oid"] in pushed.stdout and "branch v1" in pushed.stdout
    assert hub.unhandled == []


# Pushed with the library function, as `memlm kernels push` calls it; between the first two pushes someone commits a
# file of an older generation under build/ and a file of their own beside it.
REPUSH = f"""
import json, sys
from huggingface_hub import CommitOperationAdd, HfApi
from memlm.kernel_repository import push_repository
repo_id = sys.argv[1]
urls = [push_repository(repo_id)]
HfApi().create_commit(repo_id, [CommitOperationAdd({STALE!r}, b"# from an older memlm\\n"),
                                CommitOperationAdd({ADDED!r}, b"notes\\n")], repo_type="kernel", commit_message="by hand")
urls += [push_repository(repo_id, version=2), push_repository(repo_id, version=1), push_repository(repo_id)]
print(json.dumps(urls))
"""


@needs_uploads
def test_a_repush_deletes_stale_files_and_moves_only_its_version_branch(hub, tmp_path):
    """Push v1; someone adds files; push v2 (the stale build/ file goes, theirs stays); push v1 again (v1 moves to the
    new commit, v2 stays); push v1 once more with nothing changed (no commit, v1 stays)."""
    result = _run([sys.executable, "-c", REPUSH, REPUSHED], _environment(hub, tmp_path))
    assert result.returncode == 0, f"{result.stderr[-4000:]}\nfake Hub: {hub.unhandled}"
    urls = json.loads(result.stdout.splitlines()[-1])
    key = repository_key(REPUSHED, "kernel")
    commits = hub.commits[key]
    generated = f"memlm-kernels v{{}}, generated by memlm {memlm.__version__}"
    summaries = [generated.format(1), "by hand", generated.format(2), generated.format(1)]
    assert [commit["summary"] for commit in commits] == summaries
    first, by_hand, second, third = (commit["oid"] for commit in commits)
    assert urls == [f"{hub.endpoint}/{key}/commit/{oid}" for oid in (first, second, third, third)]
    # The v2 push rewrote the metadata (its version) and deleted the stale file; nothing else changed.
    metadata = sorted(path for path in _expected() if path.endswith("metadata.json"))
    assert commits[2]["paths"] == metadata + [STALE]  # the files written, then those deleted
    assert commits[3]["paths"] == metadata
    assert hub.branches[key] == {"v1": third, "v2": second}
    assert hub.files(REPUSHED, "kernel", "v2") == {**_expected(2), ADDED: b"notes\n"}
    assert hub.files(REPUSHED, "kernel", "v1") == hub.files(REPUSHED, "kernel") == {**_expected(), ADDED: b"notes\n"}
    assert hub.files(REPUSHED, "kernel", first) == _expected()  # the first push's commit is still there
    assert STALE in hub.files(REPUSHED, "kernel", by_hand)
    assert hub.unhandled == []


# Loads the pushed repository as memlm's mapping says, kernelizes a tiny DeltaNet, compares its logits with the plain
# model's and names the modules the attention's forward now comes from, with their files.
LOAD = """
import copy, json, sys
import torch
from kernels import Mode, kernelize, use_kernel_mapping
from memlm import DeltaNetForCausalLM
from memlm.kernels.hub import kernel_mapping
from tests.conftest import DELTANET_VARIANTS
torch.manual_seed(0)
model = DeltaNetForCausalLM(DELTANET_VARIANTS["fla_gated"]()).eval()
kernelized = copy.deepcopy(model)
with use_kernel_mapping(kernel_mapping(sys.argv[1])):
    kernelize(kernelized, mode=Mode.INFERENCE, device="cpu")
input_ids = torch.randint(0, 256, (2, 13))
with torch.no_grad():
    torch.testing.assert_close(kernelized(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
modules = sorted({layer.attention.forward.__func__.__module__ for layer in kernelized.model.layers})
print(json.dumps({"modules": modules, "files": [sys.modules[name].__file__ for name in modules]}))
"""


@needs_uploads
def test_the_kernels_package_loads_the_pushed_repository_from_the_hub(hub, pushed, tmp_path):
    pytest.importorskip("kernels")
    # With telemetry off, kernels 0.17.2 passes the user agent "" and huggingface_hub 2.4 makes of it a header ending
    # in "; ", which its HTTP client refuses (httpx2.LocalProtocolError); an origin after it ends the header cleanly.
    environment = {**_environment(hub, tmp_path), "HF_HUB_USER_AGENT_ORIGIN": "memlm-tests"}
    result = _run([sys.executable, "-c", LOAD, REPOSITORY], environment)
    assert result.returncode == 0, f"{result.stderr[-4000:]}\nfake Hub: {hub.unhandled}"
    loaded = json.loads(result.stdout.splitlines()[-1])
    # Downloaded into the cache at the commit v1 points at, the one variant this torch build resolves only (the
    # `kernels` package's rule: torch-cpu for a CPU build, torch-cuda for a CUDA build, also without a GPU).
    commit = hub.branches[repository_key(REPOSITORY, "kernel")]["v1"]
    snapshot = tmp_path / "hub" / "kernels--someone--memlm-kernels" / "snapshots" / commit
    variant = Path(loaded["files"][0]).relative_to(snapshot / "build").parts[0]
    assert loaded["modules"] and all(
        name.startswith(f"_memlm_kernels_{VARIANTS[variant]}_") for name in loaded["modules"]
    )
    assert all(Path(file).is_relative_to(snapshot / "build" / variant) for file in loaded["files"])
    assert [path.name for path in (snapshot / "build").iterdir()] == [variant]
    assert hub.unhandled == []


@needs_uploads
@pytest.mark.parametrize("token", [None, "hf_wrong_token"])
def test_push_without_a_valid_token_fails_in_one_line(hub, tmp_path, token):
    result = _memlm("kernels", "push", f"{PUBLISHER}/refused", environment=_environment(hub, tmp_path, token=token))
    assert result.returncode == 1
    assert result.stderr.startswith("memlm: error: ") and result.stderr.count("\n") == 1, result.stderr
    expected = "needs a Hugging Face token" if token is None else "Invalid credentials"
    assert expected in result.stderr
    assert repository_key(f"{PUBLISHER}/refused", "kernel") not in hub.repositories
    assert hub.unhandled == []


@pytest.mark.skipif(UPLOADS, reason="the installed huggingface_hub commits to kernel repositories")
def test_an_old_huggingface_hub_is_named_in_one_line(hub, tmp_path):
    result = _memlm("kernels", "push", f"{PUBLISHER}/old", environment=_environment(hub, tmp_path))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"needs huggingface_hub>={KERNEL_UPLOADS_HUB_VERSION}" in result.stderr
    assert repository_key(f"{PUBLISHER}/old", "kernel") not in hub.repositories  # nothing half done


def test_memlm_kernels_builds_and_checks_a_folder(tmp_path):
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    built = _memlm("kernels", "build", str(tmp_path), environment=environment)
    assert built.returncode == 0 and f"wrote memlm-kernels to {tmp_path}" in built.stdout, built.stderr
    (tmp_path / STALE).write_text("")
    checked = _memlm("kernels", "check", str(tmp_path), environment=environment)
    assert checked.returncode == 1 and checked.stdout == f"stale: {STALE}\n", checked.stderr
