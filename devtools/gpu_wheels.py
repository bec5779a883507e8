"""The wheels `make gpu-check` installs on the GPU machine, which reaches no network: what memlm and the check need
beyond the machine's own packages, downloaded here for its Python (CPython 3.12 on x86-64 Linux).

    python devtools/gpu_wheels.py [--folder build/gpu-wheels]      # what `make gpu-wheels` runs

The plan (:func:`plan_wheels`) starts from what the check imports: memlm's ``install_requires`` and the extras the
check exercises (Triton, flash-linear-attention, 🤗 ``kernels``; setup.cfg), and pytest with the two plugins it drives.
A requirement the machine's package meets (:data:`MACHINE_VERSIONS`, :data:`MACHINE_PACKAGES`) stops there; any other
becomes a wheel at the version constraints/tested.txt pins (the versions the suite last passed with), and that wheel's
own ``Requires-Dist`` (read from its METADATA; markers for Python 3.12 on Linux, no extras) are followed in turn. The
requirements the check never imports are named in :data:`EXCUSED`, each with its reason. torch and Triton are never
carried: the machine's CUDA builds are what the check is about.

The folder ends up holding exactly the planned wheels and ``manifest.json``: each wheel's name, version, size and
sha256, every requirement with what meets it (a wheel, the machine, or an excuse), and the size bound: the wheels and
the working tree travel together to the machine, 64 MiB in all. :func:`folder_problems` checks a folder against its
manifest; the check runs it on the machine before installing anything.
"""

import argparse
import configparser
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FOLDER = ROOT / "build" / "gpu-wheels"
MANIFEST = "manifest.json"
# What travels to the GPU machine in one call: the working tree and the carried folders together.
TRANSFER_LIMIT = 64 * 2**20

# The machine: CPython 3.12.3 on x86-64 Linux (Ubuntu 24.04's glibc 2.39), as the workplace's notes describe it.
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MARKER_ENVIRONMENT = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}
# The wheel tags the machine's pip installs, best first.
SUPPORTED_TAGS = frozenset(
    list(cpython_tags((3, 12), abis=["cp312"], platforms=PLATFORMS))
    + list(compatible_tags((3, 12), interpreter="cp312", platforms=PLATFORMS))
)

# What the machine holds, as far as it is known: the versions a session read there (`pip list`, 2026-11), and for
# packages whose version nobody read, the lowest version the machine's own packages imply (a `>=` bound).
MACHINE_VERSIONS = {
    "accelerate": "==1.15.0",
    "huggingface-hub": "==1.33.0",
    "numpy": "==2.5.2",
    "safetensors": "==0.8.0",
    "tokenizers": "==0.23.2",
    "torch": "==2.11.0",
    "transformers": "==5.17.0",
    "triton": "==3.6.0",
    # transformers 5.17.0 requires these bounds and checks them when it is imported, which it is there.
    "packaging": ">=20.0",
    "regex": ">=2025.10.22",
    "tqdm": ">=4.60",
    # PyYAML 6.0.1 is the first release with CPython 3.12 wheels.
    "pyyaml": ">=6.0.1",
}
# Every package the machine's image holds (its package list of 2026-11-17); present in some version.
MACHINE_PACKAGES = frozenset(
    canonicalize_name(name)
    for name in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
    cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
    fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
    joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
    requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
    tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
    torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()
)
# The machine's own builds are the subject of the check: a wheel of these would replace what is being checked.
NEVER_CARRIED = frozenset({"torch", "triton"})
# Requirements of carried wheels that nothing the check runs imports.
EXCUSED = {
    "sigstore": "🤗 kernels imports it only in `kernels.verify`, for its CLI's verify-signature command, which the "
    "check does not run (loading a local kernel repository verifies nothing)",
}
# What the check itself drives besides memlm: the machine's pytest and its plugins (a carried pytest would have to
# match the machine's plugins; pytest-xdist and pytest-timeout are used when present).
CHECK_REQUIREMENTS = ("pytest", "pytest-xdist", "pytest-timeout")
# The extras of setup.cfg whose code the check runs on the GPU.
CHECK_EXTRAS = ("triton", "fla", "kernels")


@dataclasses.dataclass
class Met:
    """One requirement and what meets it: ``"wheel"`` (a carried wheel), ``"machine"`` or ``"excused"``."""

    requirement: str
    needed_by: str
    met_by: str
    detail: str


@dataclasses.dataclass
class WheelPlan:
    """The wheels to carry (package → version) and every requirement followed, with what meets it."""

    wheels: dict[str, str]
    requirements: list[Met]


def root_requirements(setup_cfg: Path = ROOT / "setup.cfg") -> list[tuple[str, str]]:
    """(requirement, who needs it): memlm's install_requires and the check's extras from setup.cfg, and the check's
    own pytest requirements."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg, encoding="utf-8")

    def lines(section: str, option: str) -> list[str]:
        text = parser.get(section, option)
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    found = [(line, "memlm") for line in lines("options", "install_requires")]
    for extra in CHECK_EXTRAS:
        found += [(line, f"memlm[{extra}]") for line in lines("options.extras_require", extra)]
    return found + [(line, "the check") for line in CHECK_REQUIREMENTS]


def read_pins(path: Path = ROOT / "constraints" / "tested.txt") -> dict[str, str]:
    """Package → version from a pip constraints file of ``name==version`` lines."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: {line!r} is not name==version.")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def machine_meets(known: str | None, specifier: SpecifierSet) -> bool:
    """Whether the machine's package, known as ``"==X"``, ``">=X"`` (a lower bound only) or ``""`` (present, version
    unknown; ``None``: absent), meets ``specifier``."""
    if known is None:
        return False
    if known.startswith("=="):
        return specifier.contains(known[2:], prereleases=True)
    if known.startswith(">="):  # only a lower bound: met when every clause is a lower bound that it passes
        return all(clause.operator in (">=", ">") for clause in specifier) and specifier.contains(
            known[2:], prereleases=True
        )
    return not str(specifier)


def _known(name: str) -> str | None:
    if name in MACHINE_VERSIONS:
        return MACHINE_VERSIONS[name]
    return "" if name in MACHINE_PACKAGES else None


def plan_wheels(
    roots: list[tuple[str, str]],
    pins: dict[str, str],
    requirements_of: Callable[[str, str], list[str]],
    known: Callable[[str], str | None] = _known,
) -> WheelPlan:
    """Follow ``roots`` ((requirement, needed by) pairs) through the wheels they need: ``requirements_of(name,
    version)`` gives a wheel's Requires-Dist lines, ``known(name)`` what the machine holds (see
    :func:`machine_meets`), ``pins`` the version to carry of each package.

    Raises:
        ValueError: in one line, for a requirement no pinned version meets, an unpinned package the machine lacks, a
            requirement with extras, or torch / Triton that the machine's own build does not meet.
    """
    queue = list(roots)
    wheels: dict[str, str] = {}
    met: list[Met] = []
    while queue:
        text, needed_by = queue.pop(0)
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(MARKER_ENVIRONMENT):
            continue
        name = canonicalize_name(requirement.name)
        if requirement.extras:
            raise ValueError(f"{needed_by} requires {text!r}: requirements with extras are not planned.")
        if name in EXCUSED:
            met.append(Met(text, needed_by, "excused", EXCUSED[name]))
        elif name in wheels:
            if not requirement.specifier.contains(wheels[name], prereleases=True):
                raise ValueError(f"{needed_by} requires {text!r}, but the wheel planned is {name}=={wheels[name]}.")
            met.append(Met(text, needed_by, "wheel", f"{name}=={wheels[name]}"))
        elif machine_meets(known(name), requirement.specifier):
            met.append(Met(text, needed_by, "machine", f"{name}{known(name) or ' (version not recorded)'}"))
        elif name in NEVER_CARRIED:
            raise ValueError(f"{needed_by} requires {text!r}, which the machine's own {name} ({known(name)}) does not "
                             "meet; it is never carried.")  # fmt: skip
        else:
            if name not in pins:
                raise ValueError(f"{needed_by} requires {text!r}, which the machine lacks and constraints/tested.txt "
                                 "does not pin.")  # fmt: skip
            if not requirement.specifier.contains(pins[name], prereleases=True):
                raise ValueError(
                    f"{needed_by} requires {text!r}, but constraints/tested.txt pins {name}=={pins[name]}."
                )
            wheels[name] = pins[name]
            met.append(Met(text, needed_by, "wheel", f"{name}=={pins[name]}"))
            queue += [(line, name) for line in requirements_of(name, pins[name])]
    return WheelPlan(wheels, met)


# --- The folder -------------------------------------------------------------------------------------------------


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as archive:
        member = next(item for item in archive.namelist() if item.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(member).decode("utf-8"))
    return canonicalize_name(message["Name"]), message["Version"], message.get_all("Requires-Dist") or []


def wheel_file(folder: Path, name: str, version: str) -> Path | None:
    """The wheel of ``name`` ``version`` in ``folder``, if there is one."""
    for path in sorted(folder.glob("*.whl")):
        found, found_version, _, _ = parse_wheel_filename(path.name)
        if found == name and found_version == Version(version):
            return path
    return None


def download(folder: Path, name: str, version: str) -> Path:
    """Download the wheel of ``name==version`` for the machine into ``folder`` (kept if already there)."""
    path = wheel_file(folder, name, version)
    if path is not None:
        return path
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", PYTHON_VERSION, "--implementation", "cp"]
    command += [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    command += ["--dest", str(folder), f"{name}=={version}"]
    finished = subprocess.run(command, capture_output=True, text=True)
    path = wheel_file(folder, name, version)
    if finished.returncode != 0 or path is None:
        message = (finished.stderr.strip().splitlines() or ["no wheel saved"])[-1]
        raise RuntimeError(f"pip could not download a wheel of {name}=={version} for CPython 3.12 x86-64: {message}")
    return path


def working_tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels besides the carried folders: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout  # fmt: skip
    paths = {root / name for name in listed.decode("utf-8").split("\0") if name}
    return sum(path.lstat().st_size for path in paths if path.is_file() or path.is_symlink())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(folder: Path, plan: WheelPlan, tree_bytes: int) -> dict:
    """The manifest of a folder holding exactly ``plan``'s wheels."""
    wheels = []
    for name, version in sorted(plan.wheels.items()):
        path = wheel_file(folder, name, version)
        wheels.append({"file": path.name, "name": name, "version": version, "bytes": path.stat().st_size,
                       "sha256": sha256(path)})  # fmt: skip
    return {
        "python": f"CPython {PYTHON_VERSION}",
        "platforms": list(PLATFORMS),
        "wheels": wheels,
        "requirements": [dataclasses.asdict(item) for item in plan.requirements],
        "total_bytes": sum(wheel["bytes"] for wheel in wheels),
        "working_tree_bytes": tree_bytes,
        "limit_bytes": TRANSFER_LIMIT,
    }


def folder_problems(folder: Path) -> list[str]:
    """What is wrong with a wheel folder, one sentence each (empty: the folder is fit to carry): its manifest, a
    wheel missing, altered or not listed, two versions of a package, a wheel the machine cannot install, a requirement
    left unmet, or the size over the transfer limit."""
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{path} is missing: run `make gpu-wheels`."]
    listing = json.loads(path.read_text(encoding="utf-8"))
    problems = []
    names = [wheel["name"] for wheel in listing["wheels"]]
    for name in sorted({name for name in names if names.count(name) > 1}):
        problems.append(f"{name} is listed in more than one version.")
    for wheel in listing["wheels"]:
        file = folder / wheel["file"]
        if not file.is_file():
            problems.append(f"{wheel['file']} is listed but missing.")
            continue
        if file.stat().st_size != wheel["bytes"] or sha256(file) != wheel["sha256"]:
            problems.append(f"{wheel['file']} differs from the manifest (size or sha256).")
        name, version, _, tags = parse_wheel_filename(file.name)
        if (name, str(version)) != (wheel["name"], wheel["version"]):
            problems.append(f"{wheel['file']} is not {wheel['name']}=={wheel['version']}.")
        if not tags & SUPPORTED_TAGS:
            problems.append(f"{wheel['file']} does not install on CPython {PYTHON_VERSION} x86-64 Linux.")
    listed = {wheel["file"] for wheel in listing["wheels"]}
    problems += [
        f"{file.name} is not in the manifest." for file in sorted(folder.glob("*.whl")) if file.name not in listed
    ]
    carried = {f"{wheel['name']}=={wheel['version']}" for wheel in listing["wheels"]}
    for item in listing["requirements"]:
        if item["met_by"] not in ("wheel", "machine", "excused"):
            problems.append(f"{item['requirement']} (of {item['needed_by']}) is met by {item['met_by']!r}.")
        elif item["met_by"] == "wheel" and item["detail"] not in carried:
            problems.append(f"{item['requirement']} (of {item['needed_by']}) needs {item['detail']}, not carried.")
    total = sum(wheel["bytes"] for wheel in listing["wheels"])
    if total != listing["total_bytes"]:
        problems.append(f"the manifest's total_bytes {listing['total_bytes']} is not the wheels' {total}.")
    if total + listing["working_tree_bytes"] > listing["limit_bytes"]:
        problems.append(
            f"the wheels ({total} bytes) and the working tree ({listing['working_tree_bytes']} bytes) exceed the "
            f"{listing['limit_bytes']} bytes that travel to the machine."
        )
    return problems


# What the check's stages import: their versions are recorded, and their requirements checked against what is installed.
CHECKED_DISTRIBUTIONS = ("memlm", "transformers", "flash-linear-attention", "fla-core", "kernels")
RECORDED_DISTRIBUTIONS = CHECKED_DISTRIBUTIONS + (
    "torch", "triton", "tokenizers", "huggingface-hub", "safetensors", "accelerate", "numpy", "pytest", "pytest-xdist",
    "pytest-timeout",
)  # fmt: skip
IMPORTED_MODULES = ("memlm", "transformers", "fla", "kernels")


def installed_versions() -> dict:
    """Run where the check's stages run (the installed folder first on the path): the version of each recorded
    distribution (None: absent), where each imported module comes from (or why it does not import), and every
    requirement of the checked distributions that the installed versions leave unmet (the excused aside)."""
    import importlib
    import importlib.metadata as metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    unmet = []
    for name in CHECKED_DISTRIBUTIONS:
        if version(name) is None:
            unmet.append(f"{name} is not installed")
            continue
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            found = version(requirement.name)
            if canonicalize_name(requirement.name) in EXCUSED:
                continue
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                unmet.append(f"{name} requires {text}, installed: {found or 'none'}")
    modules = {}
    for module in IMPORTED_MODULES:
        try:
            modules[module] = importlib.import_module(module).__file__
        except Exception as error:  # what keeps it from importing is the result
            modules[module] = None
            unmet.append(f"import {module} fails: {type(error).__name__}: {error}".splitlines()[0])
    return {"versions": {name: version(name) for name in RECORDED_DISTRIBUTIONS}, "modules": modules, "unmet": unmet}


def prepare(folder: Path) -> dict:
    """Plan, download and list the wheels in ``folder``; remove the wheels of an earlier plan. Returns the manifest.

    Raises:
        RuntimeError: when a download fails, or the folder comes out unfit (naming the problems).
    """
    folder.mkdir(parents=True, exist_ok=True)

    def requirements_of(name: str, version: str) -> list[str]:
        found, found_version, requirements = wheel_metadata(download(folder, name, version))
        if (found, Version(found_version)) != (name, Version(version)):
            raise RuntimeError(f"the wheel downloaded for {name}=={version} holds {found}=={found_version}.")
        return requirements

    plan = plan_wheels(root_requirements(), read_pins(), requirements_of)
    keep = {wheel_file(folder, name, version) for name, version in plan.wheels.items()}
    for path in folder.glob("*.whl"):
        if path not in keep:
            path.unlink()
    listing = manifest(folder, plan, working_tree_bytes())
    (folder / MANIFEST).write_text(json.dumps(listing, indent=2) + "\n", encoding="utf-8")
    problems = folder_problems(folder)
    if problems:
        raise RuntimeError(f"{folder} is not fit to carry: " + " ".join(problems))
    return listing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--folder", type=Path, default=DEFAULT_FOLDER, help="where the wheels go (default %(default)s)"
    )
    arguments = parser.parse_args(argv)
    try:
        listing = prepare(arguments.folder)
    except (RuntimeError, ValueError) as error:
        print(f"gpu-wheels: {error}", file=sys.stderr)
        return 1
    for wheel in listing["wheels"]:
        print(f"{wheel['file']}  {wheel['bytes'] / 2**20:.1f} MiB")
    for item in listing["requirements"]:
        if item["met_by"] == "excused":
            print(f"not carried: {item['requirement']} (of {item['needed_by']}): {item['detail']}")
    folder = os.path.relpath(arguments.folder, ROOT)
    print(f"{len(listing['wheels'])} wheels, {listing['total_bytes'] / 2**20:.1f} MiB, in {folder}; with the working "
          f"tree ({listing['working_tree_bytes'] / 2**20:.1f} MiB) {(listing['total_bytes'] + listing['working_tree_bytes']) / 2**20:.1f} "
          f"of the {TRANSFER_LIMIT / 2**20:.0f} MiB that travel.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
