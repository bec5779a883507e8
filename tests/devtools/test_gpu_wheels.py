"""devtools/gpu_wheels.py (`make gpu-wheels`): the plan of the wheels a GPU machine without network needs, on the
wheels' recorded requirements (nothing is downloaded here), and the check of a folder against its manifest."""

import json
import subprocess
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from devtools import gpu_wheels
from devtools.gpu_wheels import (
    DEFAULT_FOLDER,
    TRANSFER_LIMIT,
    folder_problems,
    machine_meets,
    manifest,
    plan_wheels,
    read_pins,
    root_requirements,
    wheel_metadata,
    working_tree_bytes,
)

# The Requires-Dist lines of the wheels the plan carries, as their METADATA holds them (extras' lines partly kept:
# the plan must leave them out).
REQUIRES_DIST = {
    ("transformers", "5.24.0"): [
        "huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1", "regex>=2025.10.22",
        "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0", "tqdm>=4.60", 'torch>=2.6; extra == "torch"',
        'kernels<0.19,>=0.18.2; extra == "kernels"',
    ],
    ("flash-linear-attention", "0.6.0"): ["fla-core==0.6.0", "transformers<6,>=5.6.2",
                                          'fla-core[cuda]==0.6.0; extra == "cuda"'],
    ("fla-core", "0.6.0"): ["einops", 'torch>=2.7.0; extra == "cuda"', 'triton>=3.3; extra == "cuda"'],
    ("kernels", "0.17.2"): [
        "huggingface-hub>=1.10.0", "packaging>=20.0", "pyyaml>=6", "sigstore>=4,<5",
        "tomli>=2.0 ; python_full_version < '3.11'", "typing-extensions>=4.0 ; python_full_version < '3.11'",
        "tomlkit>=0.13.3", "torch ; extra == 'torch'",
    ],
    ("tomlkit", "0.15.2"): [],
    ("tokenizers", "0.23.3"): ["huggingface-hub>=0.16.4,<3.0"],
}  # fmt: skip
PINS = {name: version for name, version in REQUIRES_DIST}


def recorded(name: str, version: str) -> list[str]:
    return REQUIRES_DIST[name, version]


def test_the_plan_carries_what_the_machine_lacks_and_meets_every_requirement():
    plan = plan_wheels(root_requirements(), PINS, recorded)
    assert plan.wheels == {"transformers": "5.24.0", "flash-linear-attention": "0.6.0", "fla-core": "0.6.0",
                           "kernels": "0.17.2", "tomlkit": "0.15.2"}  # fmt: skip
    met = {item.requirement: item for item in plan.requirements}
    assert met["torch>=2.11"].met_by == "machine" and met["transformers>=5.21,<6"].met_by == "wheel"
    assert met["tokenizers>=0.23.1"].met_by == "machine" and met["regex>=2025.10.22"].met_by == "machine"
    assert met["pyyaml>=6"].met_by == "machine" and met["pytest"].met_by == "machine"
    assert [item.requirement for item in plan.requirements if item.met_by == "excused"] == ["sigstore>=4,<5"]
    assert not any(item.requirement.startswith(("tomli", "typing-extensions")) for item in plan.requirements)
    # One version of each package: a package is met by a wheel or by the machine, never both.
    by_package = {}
    for item in plan.requirements:
        by_package.setdefault(canonicalize_name(Requirement(item.requirement).name), set()).add(item.met_by)
    assert all(len(kinds) == 1 for kinds in by_package.values()), by_package


def test_a_machine_package_too_old_is_carried_at_its_pin():
    def known(name):
        return "==0.22.0" if name == "tokenizers" else gpu_wheels._known(name)

    plan = plan_wheels(root_requirements(), PINS, recorded, known)
    assert plan.wheels["tokenizers"] == "0.23.3"
    assert {item.needed_by for item in plan.requirements if item.requirement.startswith("tokenizers")} == {
        "memlm", "transformers"
    }  # fmt: skip


def test_what_cannot_be_planned_is_refused_in_one_line():
    roots = [("transformers>=5.21,<6", "memlm")]
    with pytest.raises(ValueError, match=r"^memlm requires 'transformers>=5.21,<6', but constraints/tested.txt pins "
                                         r"transformers==5.20.0\.$"):  # fmt: skip
        plan_wheels(roots, {"transformers": "5.20.0"}, recorded)
    with pytest.raises(
        ValueError, match=r"requires 'no-such-package', which the machine lacks and constraints/tested"
    ):
        plan_wheels([("no-such-package", "memlm")], PINS, recorded)
    with pytest.raises(ValueError, match=r"requires 'torch>=3', which the machine's own torch \(==2.11.0\) does not "):
        plan_wheels([("torch>=3", "memlm")], {"torch": "3.0"}, recorded)
    with pytest.raises(ValueError, match=r"requires 'fla-core\[cuda\]==0.6.0': requirements with extras"):
        plan_wheels([("fla-core[cuda]==0.6.0", "memlm")], PINS, recorded)


@pytest.mark.parametrize(
    ("known", "specifier", "meets"),
    [
        ("==2.11.0", ">=2.4", True),
        ("==5.17.0", ">=5.21,<6", False),
        (">=2025.10.22", ">=2025.10.22", True),
        (">=5.1", ">=6", False),
        (">=20.0", ">=20,<30", False),  # a lower bound says nothing of an upper one
        ("", "", True),
        ("", ">=1", False),
        (None, "", False),
    ],
)
def test_what_the_machine_is_known_to_hold_meets_a_requirement_only_when_certain(known, specifier, meets):
    assert machine_meets(known, SpecifierSet(specifier)) is meets


def test_the_pins_come_from_constraints_and_fit_setup_cfg():
    pins = read_pins()
    assert Version(pins["transformers"]) in SpecifierSet(">=5.21,<6")
    assert {"flash-linear-attention", "fla-core", "kernels", "tomlkit"} <= set(pins)


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    """A wheel file holding only its METADATA."""
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    with zipfile.ZipFile(path, "w") as archive:
        text = "\n".join(lines + [f"Requires-Dist: {line}" for line in requires]) + "\n"
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", text)
    return path


def _planned_folder(folder):
    """A folder with two wheels (one needing the other) and its manifest, as `prepare` writes it."""
    _wheel(folder, "alpha", "1.0", ["beta>=2", "numpy>=1.17"])
    _wheel(folder, "beta", "2.1", tag="cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64")

    def requirements_of(name, version):
        return wheel_metadata(gpu_wheels.wheel_file(folder, name, version))[2]

    plan = plan_wheels([("alpha", "memlm")], {"alpha": "1.0", "beta": "2.1"}, requirements_of)
    (folder / "manifest.json").write_text(json.dumps(manifest(folder, plan, tree_bytes=1000)))
    return plan


def test_a_planned_folder_is_fit_to_carry_and_each_defect_is_named(tmp_path):
    plan = _planned_folder(tmp_path)
    assert plan.wheels == {"alpha": "1.0", "beta": "2.1"}
    assert folder_problems(tmp_path) == []
    listing = json.loads((tmp_path / "manifest.json").read_text())
    assert listing["total_bytes"] == sum(path.stat().st_size for path in tmp_path.glob("*.whl"))

    _wheel(tmp_path, "beta", "2.2")  # a second version, not in the manifest
    assert folder_problems(tmp_path) == ["beta-2.2-py3-none-any.whl is not in the manifest."]
    (tmp_path / "beta-2.2-py3-none-any.whl").unlink()

    alpha = tmp_path / "alpha-1.0-py3-none-any.whl"
    alpha.write_bytes(alpha.read_bytes() + b"\0")
    assert folder_problems(tmp_path) == ["alpha-1.0-py3-none-any.whl differs from the manifest (size or sha256)."]

    _planned_folder(tmp_path)  # whole again
    wrong = dict(listing, wheels=listing["wheels"] + [listing["wheels"][1]], working_tree_bytes=TRANSFER_LIMIT)
    (tmp_path / "manifest.json").write_text(json.dumps(wrong))
    problems = folder_problems(tmp_path)
    assert "beta is listed in more than one version." in problems
    assert any(problem.startswith("the manifest's total_bytes") for problem in problems)
    assert any("exceed the 67108864 bytes that travel" in problem for problem in problems)


def test_a_wheel_for_another_python_or_machine_is_refused(tmp_path):
    for tag in ("cp311-cp311-manylinux_2_17_x86_64", "cp312-cp312-manylinux_2_17_aarch64", "cp312-cp312-win_amd64"):
        folder = tmp_path / tag
        folder.mkdir()
        path = _wheel(folder, "gamma", "1.0", tag=tag)
        plan = plan_wheels([("gamma", "memlm")], {"gamma": "1.0"}, lambda name, version: [])
        (folder / "manifest.json").write_text(json.dumps(manifest(folder, plan, tree_bytes=0)))
        assert folder_problems(folder) == [f"{path.name} does not install on CPython 3.12 x86-64 Linux."]
    assert folder_problems(tmp_path / "nothing") == [f"{tmp_path / 'nothing' / 'manifest.json'} is missing: run "
                                                     "`make gpu-wheels`."]  # fmt: skip


def test_the_working_tree_counts_tracked_and_untracked_files_not_the_ignored(tmp_path):
    def git(*arguments):
        subprocess.run(["git", *arguments], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "tracked.txt").write_text("x" * 10)
    git("add", "tracked.txt", ".gitignore")
    (tmp_path / "untracked.txt").write_text("y" * 20)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "wheel.whl").write_bytes(b"z" * 1000)
    assert working_tree_bytes(tmp_path) == 10 + 20 + len("build/\n")


def test_the_prepared_folder_if_made_is_fit_to_carry():
    """After `make gpu-wheels`: the real folder, its wheels for CPython 3.12 x86-64, under the transfer limit."""
    if not (DEFAULT_FOLDER / "manifest.json").is_file():
        pytest.skip("make gpu-wheels has not been run here")
    assert folder_problems(DEFAULT_FOLDER) == []
    listing = json.loads((DEFAULT_FOLDER / "manifest.json").read_text())
    assert {wheel["name"] for wheel in listing["wheels"]} >= {"transformers", "flash-linear-attention", "kernels"}
