# Two commands do everything on a fresh machine:
#   make main   set up .venv, then build a small DeltaNet and generate from a prompt (text and speed)
#   make test   set up .venv, then run ruff, the docs build (make docs), the test suite (without the tests marked slow,
#               with every example of the documentation), make test-recorded and the installed-wheel check
#   make test-recorded   the tests that compare with numbers recorded in a file, again under ATEN_CPU_CAPABILITY=default
#   make docs   build the documentation site (mkdocs.yml, docs/) with --strict into build/site, which is never committed
#   make test-releases   the 🤗-facing tests under the newest and the oldest 🤗 releases setup.cfg allows
#   make constraints     record the packages of .venv (after make test passed with them) in constraints/tested.txt
#   make test-slow   the tests marked slow: every GPU-compile scenario, pipelining checks, long exports
#   make wheel-check   the wheel installed alone (CPU torch, no Triton, no dev extras) and used from an empty folder
# A GPU machine without network, in two steps (docs/development.md, "The GPU check"):
#   make gpu-wheels    here: download into build/gpu-wheels the wheels such a machine lacks (CPython 3.12, x86-64), with
#                      a manifest; the folder travels with the working tree (64 MiB together at most)
#   make gpu-check     there, with build/gpu-wheels beside the tree: install them and memlm, run the tests marked gpu,
#                      time the kernels and the models; writes gpu_check.json and gpu_check.log into $OUT (or
#                      build/gpu-check) within 8 minutes; refuses in one line without CUDA. It uses the machine's python3
#                      (PYTHON), never .venv
# torch==2.13.0 is installed first and alone: an unpinned torch would pull a multi-GB CUDA build. .venv gets the
# versions of constraints/tested.txt, so that both commands work whatever the registry published since.

PYTHON ?= python3
# pytest-xdist workers for make test and make test-releases: one per core of a CI machine (2).
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: main test test-recorded docs test-slow test-releases wheel-check constraints benchmark papers gpu-wheels gpu-check clean

# A download cut short by the network fails a whole run (CI once lost Triton's wheel at 211 of 286 MB, resumed five times
# from the same byte): every pip below, and those the check scripts start, retries a dropped connection and resumes a
# cut download, and an install that fails all the same is started again from scratch, up to three times.
export PIP_RETRIES ?= 10
export PIP_RESUME_RETRIES ?= 10
retried = @echo '$(1)'; for attempt in 1 2 3; do $(1) && break; [ $$attempt -lt 3 ] || exit 1; \
	echo "install failed (attempt $$attempt of 3); again in 30 s"; sleep 30; done

$(STAMP): setup.cfg pyproject.toml constraints/tested.txt
	@$(PYTHON) devtools/check_python.py
	$(PYTHON) -m venv $(VENV)
	$(call retried,$(BIN)/python -m pip install --quiet --upgrade pip)
	$(call retried,$(BIN)/python -m pip install --quiet torch==2.13.0)
	$(call retried,$(BIN)/python -m pip install --quiet -c constraints/tested.txt -e ".[dev]")
	touch $(STAMP)

main: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python training/quickstart.py

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(MAKE) --no-print-directory docs
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" --durations=20 -n $(TEST_WORKERS)
	$(MAKE) --no-print-directory test-recorded
	$(BIN)/python tests/installed/check_wheel.py --python $(PYTHON)
	$(BIN)/python tests/installed/check_quantization.py --workers $(TEST_WORKERS)

# The tests that compare with numbers recorded in a file (marked `recorded` by tests/conftest.py), again with ATen's
# portable kernels: other bits for matrix products, softmax and norms, as another processor computes them.
test-recorded: $(STAMP)
	ATEN_CPU_CAPABILITY=default HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "recorded and not slow" -n $(TEST_WORKERS)

# --strict: a broken link or anchor, an API reference that does not resolve or a docstring griffe cannot read fails.
# NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2.0.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m slow

test-releases: $(STAMP)
	$(BIN)/python tests/installed/check_releases.py --python $(PYTHON) --workers $(TEST_WORKERS)

constraints:
	printf '%s\n' "# The versions make main and make test install (pip constraints): the set the suite last passed with." \
		"# Written by make constraints from .venv; torch is the local CPU build." > constraints/tested.txt
	$(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==.*/torch==2.13.0/' >> constraints/tested.txt

wheel-check: $(STAMP)
	$(BIN)/python tests/installed/check_wheel.py --python $(PYTHON)

benchmark: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/delta_rule.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/expire_span.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/feedback.py

papers: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/paper_deltanet.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/paper_expire_span.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/paper_feedback.py

gpu-wheels: $(STAMP)
	$(BIN)/python devtools/gpu_wheels.py --folder build/gpu-wheels

gpu-check:
	$(PYTHON) devtools/gpu_check.py --wheels build/gpu-wheels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
