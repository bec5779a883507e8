"""Shared fixtures: tiny DeltaNet configurations covering every option, and a real byte-level tokenizer."""

import logging
import os
import sys
from pathlib import Path

# Tests never reach a hub: everything they load they built themselves.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test` runs one worker per core) each worker, and what it starts, computes on one thread:
# two workers of two threads each on two cores would fight over them.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter (read when a kernel is defined, so set before any
# memlm Triton module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from devtools import recorded_numbers  # noqa: E402
from memlm import DeltaNetConfig  # noqa: E402
from memlm.configuration.configuration_deltanet import LMTOOL_FWP_LAYOUT  # noqa: E402
from memlm.tokenization import byte_level_tokenizer  # noqa: E402

TINY = {
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "chunk_size": 8,
    "eos_token_id": 256,
    "bos_token_id": 256,
    "pad_token_id": 257,
}

# lmtool-fwp's model as memlm.conversion.lmtool_fwp converts it (attn_type 24, normaliser on, adaptive softmax).
OFFICIAL_BLOCK = {
    **LMTOOL_FWP_LAYOUT,
    "feature_map": "elu+1",
    "query_key_normalization": "sum",
    "attention_output_bias": True,  # not the official model's: covers the option
    "embedding_scale": 32**0.5,
    "adaptive_softmax_cutoffs": [64, 200],
    "position_encoding": "none",  # sinusoidal positions restart every call: tested on their own
}

# Each variant turns on a different set of options, so that together they cover every config field.
DELTANET_VARIANTS = {
    "paper": lambda **extra: DeltaNetConfig.from_preset("paper", **{**TINY, **extra}),
    "fla": lambda **extra: DeltaNetConfig.from_preset("fla", **{**TINY, **extra}),
    "fla_gated": lambda **extra: DeltaNetConfig.from_preset("fla", output_gate=True, **{**TINY, **extra}),
    "sum_rule_normalised": lambda **extra: DeltaNetConfig(
        feature_map="elu+1",
        query_key_normalization="none",
        update_rule="sum",
        attention_normalizer=True,
        **{**TINY, **extra},
    ),
    "favor_conv_gate": lambda **extra: DeltaNetConfig(
        feature_map="favor+",
        favor_features=12,
        query_key_normalization="l2",
        short_convolution=True,
        convolution_size=3,
        output_gate=True,
        **{**TINY, **extra},
    ),
    "dpfp3_no_beta": lambda **extra: DeltaNetConfig(
        feature_map="dpfp",
        dpfp_nu=3,
        query_key_normalization="sum",
        use_beta=False,
        output_norm=True,
        value_head_dim=12,
        **{**TINY, **extra},
    ),
    # The official code's block (Transformer-XL, lmtool-fwp attn_type 24 with its normaliser) around the delta rule.
    "official_block": lambda **extra: DeltaNetConfig(**{**OFFICIAL_BLOCK, **TINY, **extra}),
    "identity_sum_rule": lambda **extra: DeltaNetConfig(
        feature_map="identity",
        query_key_normalization="none",
        update_rule="sum",
        use_beta=False,
        scale_queries=True,
        key_head_dim=8,
        **{**TINY, **extra},
    ),
}


@pytest.fixture(params=list(DELTANET_VARIANTS))
def deltanet_config(request) -> DeltaNetConfig:
    return DELTANET_VARIANTS[request.param]()


@pytest.fixture(params=["paper", "fla"])
def preset_config(request) -> DeltaNetConfig:
    return DELTANET_VARIANTS[request.param]()


@pytest.fixture(scope="session")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Where memlm's own code lives: the library, its scripts and its tests.
OWN_CODE = tuple(
    str(Path(__file__).resolve().parents[1] / folder) for folder in ("memlm", "training", "benchmarks", "tests")
)


def _deprecated_by_own_code() -> bool:
    """Whether the code that made 🤗 log the record being emitted is memlm's: the nearest caller outside 🤗
    Transformers and Python's logging is in memlm's tree (a third-party library's own use is its business)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (
            "/transformers/" in filename
            or filename == logging.__file__
            or filename == __file__
            or filename.endswith("functools.py")
        ):
            return filename.startswith(OWN_CODE)
        frame = frame.f_back
    return False


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.deprecations = []

    def emit(self, record):
        message = record.getMessage()
        if "deprecat" in message.lower() and _deprecated_by_own_code():
            self.deprecations.append(message)


@pytest.fixture(autouse=True)
def _no_deprecation_logged_by_transformers():
    """🤗 announces some deprecations through its logger rather than as warnings (`outputs.past_key_values` under
    5.24 logs "`past_key_values`/`cache_params` are deprecated"), once per process. A test in which memlm's own code
    makes 🤗 log one fails, as a deprecation warning does (setup.cfg): both are tomorrow's errors."""
    records = _Records()
    library_logger = transformers_logging.get_logger("transformers")
    library_logger.addHandler(records)
    logging.Logger.warning_once.cache_clear()  # so that each test hears what an earlier test already triggered
    yield
    library_logger.removeHandler(records)
    assert not records.deprecations, f"🤗 Transformers logged a deprecation of memlm's: {records.deprecations}"


KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"


def pytest_collection_modifyitems(config, items):
    """Every test of tests/kernels is marked `kernels`: `make test-releases` runs them under other torch builds. The
    tests that compare with numbers recorded in a file (devtools/recorded_numbers.py reads them off the test
    modules) are marked `recorded`: `make test` runs them again with ATEN_CPU_CAPABILITY=default."""
    modules, shared = {}, recorded_numbers.conftest_fixtures(Path(__file__).resolve().parent)
    for item in items:
        path = Path(str(item.fspath))
        if path.is_relative_to(KERNEL_TESTS):
            item.add_marker(pytest.mark.kernels)
        if path not in modules:
            modules[path] = (
                recorded_numbers.read_module(path, shared).tests if path.name.startswith("test_") else set()
            )
        name = "::".join(part.split("[")[0] for part in item.nodeid.split("::")[1:])
        if name in modules[path]:
            item.add_marker(pytest.mark.recorded)
