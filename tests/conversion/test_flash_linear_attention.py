"""Loading flash-linear-attention DeltaNet checkpoints: names, shapes and semantics.

The expected logits come from `fla_forward`, an independent reading of FLA's DeltaNet (fla/models/delta_net and
fla/layers/delta_net.py) that works on the FLA state dict directly: per-projection short convolutions followed by
SiLU, L2-normalised keys and queries, queries scaled by d_k^-1/2, the delta rule as FLA's naive recurrence, per-head
RMSNorm (gated by silu(g) when use_gate), and a SwiGLU MLP. With flash-linear-attention installed, a checkpoint that
FLA's own DeltaNetForCausalLM wrote is also loaded and checked against that model's logits (its Triton kernels run in
Triton's interpreter without a GPU).
"""

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.conversion.flash_linear_attention import convert_config, load_fla_deltanet, main

FLA_CONFIG = {
    "model_type": "delta_net",
    "hidden_size": 32,
    "num_heads": 2,
    "num_hidden_layers": 2,
    "expand_k": 1.0,
    "expand_v": 1.0,
    "use_gate": False,
    "use_short_conv": True,
    "conv_size": 4,
    "use_beta": True,
    "use_output_norm": True,
    "qk_norm": "l2",
    "qk_activation": "silu",
    "hidden_ratio": 4,
    "intermediate_size": None,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "vocab_size": 100,
    "tie_word_embeddings": False,
    "attn": None,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "fuse_cross_entropy": True,
}


def fla_state_dict(config: dict) -> dict[str, torch.Tensor]:
    hidden, heads = config["hidden_size"], config["num_heads"]
    key_width, value_width = int(hidden * config["expand_k"]), int(hidden * config["expand_v"])
    intermediate = 256 * ((int(hidden * config["hidden_ratio"] * 2 / 3) + 255) // 256)
    state = {
        "model.embeddings.weight": torch.randn(config["vocab_size"], hidden),
        "model.norm.weight": 1 + 0.1 * torch.randn(hidden),
    }
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = torch.randn(config["vocab_size"], hidden) * 0.2
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        state.update(
            {
                prefix + "attn_norm.weight": 1 + 0.1 * torch.randn(hidden),
                prefix + "attn.q_proj.weight": torch.randn(key_width, hidden) * 0.2,
                prefix + "attn.k_proj.weight": torch.randn(key_width, hidden) * 0.2,
                prefix + "attn.v_proj.weight": torch.randn(value_width, hidden) * 0.2,
                prefix + "attn.o_norm.weight": 1 + 0.1 * torch.randn(value_width // heads),
                prefix + "attn.o_proj.weight": torch.randn(hidden, value_width) * 0.2,
                prefix + "mlp_norm.weight": 1 + 0.1 * torch.randn(hidden),
                prefix + "mlp.gate_proj.weight": torch.randn(intermediate, hidden) * 0.2,
                prefix + "mlp.up_proj.weight": torch.randn(intermediate, hidden) * 0.2,
                prefix + "mlp.down_proj.weight": torch.randn(hidden, intermediate) * 0.2,
            }
        )
        if config["use_beta"]:
            state[prefix + "attn.b_proj.weight"] = torch.randn(heads, hidden) * 0.2
        if config["use_gate"]:
            state[prefix + "attn.g_proj.weight"] = torch.randn(value_width, hidden) * 0.2
        if config["use_short_conv"]:
            for name, width in (("q", key_width), ("k", key_width), ("v", value_width)):
                state[prefix + f"attn.{name}_conv1d.weight"] = torch.randn(width, 1, config["conv_size"]) * 0.5
    return state


def fla_forward(state: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor) -> torch.Tensor:
    eps, heads = config["norm_eps"], config["num_heads"]

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def short_conv(x, weight, activation):  # x (B, T, C); FLA's causal_conv1d, zero history
        y = F.conv1d(x.transpose(1, 2), weight, padding=weight.shape[-1] - 1, groups=x.shape[-1])
        y = y[..., : x.shape[1]].transpose(1, 2)
        return F.silu(y) if activation else y

    hidden = state["model.embeddings.weight"][input_ids]
    batch, length, _ = hidden.shape
    for index in range(config["num_hidden_layers"]):
        p = f"model.layers.{index}."
        x = rms_norm(hidden, state[p + "attn_norm.weight"])
        q, k, v = (x @ state[p + f"attn.{n}_proj.weight"].T for n in "qkv")
        silu_features = config["qk_activation"] == "silu"
        if config["use_short_conv"]:
            q = short_conv(q, state[p + "attn.q_conv1d.weight"], silu_features)
            k = short_conv(k, state[p + "attn.k_conv1d.weight"], silu_features)
            v = short_conv(v, state[p + "attn.v_conv1d.weight"], True)
        else:
            if silu_features:
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        q, k, v = (t.view(batch, length, heads, -1) for t in (q, k, v))
        if config["qk_activation"] == "elu":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        if config["qk_norm"] == "l2":
            q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        else:
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        beta = (
            torch.sigmoid(x @ state[p + "attn.b_proj.weight"].T)
            if config["use_beta"]
            else torch.ones(batch, length, heads)
        )
        scale = q.shape[-1] ** -0.5
        memory = torch.zeros(batch, heads, q.shape[-1], v.shape[-1])
        outputs = []
        for t in range(length):  # fla/ops/delta_rule/naive.py: v -= S k; v *= β; S += k vᵀ; o = S (q·scale)
            new_value = (v[:, t] - torch.einsum("bhkv,bhk->bhv", memory, k[:, t])) * beta[:, t, :, None]
            memory = memory + k[:, t, :, :, None] * new_value[:, :, None, :]
            outputs.append(torch.einsum("bhkv,bhk->bhv", memory, q[:, t] * scale))
        o = rms_norm(torch.stack(outputs, 1), state[p + "attn.o_norm.weight"])
        if config["use_gate"]:
            o = o * F.silu((x @ state[p + "attn.g_proj.weight"].T).view(batch, length, heads, -1))
        hidden = hidden + o.reshape(batch, length, -1) @ state[p + "attn.o_proj.weight"].T
        x = rms_norm(hidden, state[p + "mlp_norm.weight"])
        gate, up = x @ state[p + "mlp.gate_proj.weight"].T, x @ state[p + "mlp.up_proj.weight"].T
        hidden = hidden + (F.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    hidden = rms_norm(hidden, state["model.norm.weight"])
    head = state["model.embeddings.weight"] if config["tie_word_embeddings"] else state["lm_head.weight"]
    return hidden @ head.T


def _write(directory, config, state):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"use_gate": True},
        {"use_short_conv": False},
        {"qk_activation": "elu", "qk_norm": "sum", "expand_k": 0.5},
        {"use_beta": False, "tie_word_embeddings": True, "expand_v": 2.0},
    ],
)
def test_converted_model_matches_an_independent_fla_forward(tmp_path, changes):
    config = {**FLA_CONFIG, **changes}
    state = fla_state_dict(config)
    model = load_fla_deltanet(_write(tmp_path / "fla", config, state))
    input_ids = torch.randint(0, 100, (2, 13))
    with torch.no_grad():
        logits = model(input_ids).logits
    torch.testing.assert_close(logits, fla_forward(state, config, input_ids), atol=1e-4, rtol=1e-4)


def test_old_layouts_fused_mlp_and_norm_first(tmp_path):
    config = dict(FLA_CONFIG)
    state = fla_state_dict(config)
    expected = fla_forward(state, config, torch.tensor([[1, 2, 3, 4, 5]]))
    old = dict(state)
    for index in range(config["num_hidden_layers"]):
        p = f"model.layers.{index}."
        old[p + "mlp.gate_proj.weight"] = torch.cat(
            [old[p + "mlp.gate_proj.weight"], old.pop(p + "mlp.up_proj.weight")]
        )
        old[p + "attn.norm.weight"] = old.pop(p + "attn_norm.weight")
        old[p + "mlp.norm.weight"] = old.pop(p + "mlp_norm.weight")
    model = load_fla_deltanet(_write(tmp_path / "old", config, old))
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([[1, 2, 3, 4, 5]])).logits, expected, atol=1e-4, rtol=1e-4)


def test_strict_about_names_and_shapes(tmp_path):
    config = dict(FLA_CONFIG)
    state = fla_state_dict(config)
    extra = {**state, "model.layers.0.attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ValueError, match=r"weights memlm would not use: \['model.layers.0.attn.q_norm.weight'\]"):
        load_fla_deltanet(_write(tmp_path / "extra", config, extra))
    missing = {name: tensor for name, tensor in state.items() if name != "model.layers.1.attn.k_proj.weight"}
    with pytest.raises(ValueError, match="lacks 'model.layers.1.attn.k_proj.weight'"):
        load_fla_deltanet(_write(tmp_path / "missing", config, missing))
    wrong = {**state, "model.layers.0.attn.v_proj.weight": torch.zeros(30, 32)}
    with pytest.raises(ValueError, match=r"attention.v_proj.weight: checkpoint \(30, 32\) vs model \(32, 32\)"):
        load_fla_deltanet(_write(tmp_path / "wrong", config, wrong))
    with pytest.raises(ValueError, match="No \\*.safetensors weights"):
        load_fla_deltanet(_pickled_only(tmp_path))


def _pickled_only(tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(FLA_CONFIG))
    (directory / "pytorch_model.bin").write_bytes(b"not loaded")
    return directory


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "model_type is 'llama', expected 'delta_net'"),
        ({"attn": {"layers": [1], "num_heads": 2}}, "mixes softmax-attention layers"),
        ({"qk_activation": "relu"}, "qk_activation='relu' has no memlm feature map"),
        ({"allow_neg_eigval": True}, "allow_neg_eigval"),
        ({"attnres_block_size": 4}, "attention residuals"),
        ({"hidden_act": "gelu"}, "only supports 'swish'"),
        ({"qk_norm": "sum"}, "needs a non-negative feature map"),
    ],
)
def test_unsupported_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        convert_config({**FLA_CONFIG, **changes})


def test_command_line_writes_a_memlm_checkpoint(tmp_path, tokenizer):
    config = dict(FLA_CONFIG)
    state = fla_state_dict(config)
    source = _write(tmp_path / "fla", config, state)
    tokenizer.save_pretrained(source)
    main([str(source), str(tmp_path / "memlm")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "memlm")
    assert type(model) is DeltaNetForCausalLM
    assert (tmp_path / "memlm" / "tokenizer.json").is_file()
    input_ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids).logits, fla_forward(state, config, input_ids), atol=1e-4, rtol=1e-4
        )


def test_flash_linear_attention_and_memlm_coexist_in_one_process(tmp_path):
    fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is an optional package")
    from transformers import AutoConfig

    assert type(AutoConfig.for_model("delta_net")).__module__.startswith("fla.")
    assert type(AutoConfig.for_model("memlm_deltanet")) is DeltaNetConfig
    # A real FLA checkpoint (FLA builds and saves it; its Triton kernels are not needed for that) loads strictly.
    fla_config = fla_models.DeltaNetConfig(
        hidden_size=64, num_heads=2, num_hidden_layers=2, vocab_size=100, use_gate=True
    )
    fla_model = fla_models.DeltaNetForCausalLM(fla_config)
    fla_model.save_pretrained(tmp_path / "fla")
    model = load_fla_deltanet(tmp_path / "fla")
    torch.testing.assert_close(
        model.model.layers[1].attention.g_proj.weight, fla_model.state_dict()["model.layers.1.attn.g_proj.weight"]
    )


@pytest.fixture
def fla_models_running_here(monkeypatch):
    """FLA's models, with its Triton kernels ready to run on this machine's tensors: on a GPU as they are, on CPU in
    Triton's interpreter as tests/kernels/test_fla_backend.py explains (one configuration per autotuned kernel, and
    int32 loop indices as compiled Triton has)."""
    from memlm.kernels import flash_linear_attention_available

    if not flash_linear_attention_available():
        pytest.skip("flash-linear-attention >= 0.6 (pip install memlm[fla]) and triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("FLA's kernels need CUDA or Triton's interpreter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # on CPU: "Triton is not supported on current platform"
        import fla.models
        from fla.ops.common import chunk_delta_h
    if not torch.cuda.is_available():
        from tests.kernels.test_fla_backend import _first_configuration_only, _interpreter_range

        _first_configuration_only(monkeypatch)
        monkeypatch.setattr(chunk_delta_h, "range", _interpreter_range, raising=False)
    return fla.models


def test_converted_checkpoint_gives_the_logits_of_flas_own_model(tmp_path, fla_models_running_here):
    torch.manual_seed(0)
    fla_config = fla_models_running_here.DeltaNetConfig(
        hidden_size=64, num_heads=2, num_hidden_layers=2, vocab_size=100, use_gate=True
    )
    fla_model = fla_models_running_here.DeltaNetForCausalLM(fla_config).eval()
    with torch.no_grad():  # away from the initialisation (unit norms, zero-initialised projections)
        for parameter in fla_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    fla_model.save_pretrained(tmp_path / "fla")
    model = load_fla_deltanet(tmp_path / "fla")
    input_ids = torch.randint(0, 100, (2, 13))
    with torch.no_grad():
        expected = fla_model(input_ids).logits  # FLA's layers and kernels (fused_recurrent_delta_rule at 13 tokens)
        torch.testing.assert_close(model(input_ids).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("config_text", "message"),
    [
        (
            '{"model_type": "delta_net", "hidden_size": "x"}',
            "The FLA config's hidden_size must be a positive integer, got 'x'.",
        ),
        ('{"model_type": "delta_net", "expand_k": 0}', "The FLA config's expand_k must be a positive number, got 0."),
        ("[1, 2]", "An FLA config.json holds a JSON object, got list."),
        ("{broken", "config.json is not valid JSON (Expecting property name"),
        (None, "model.safetensors cannot be read (Error while deserializing header"),
    ],
)
def test_the_command_line_names_a_broken_checkpoint_in_one_line(tmp_path, capsys, config_text, message):
    """Bad values, a config that is not an object or not JSON, weights cut short: one line and exit status 1."""
    source = _write(tmp_path / "source", FLA_CONFIG, fla_state_dict(FLA_CONFIG))
    if config_text is None:
        weights = (source / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    else:
        (source / "config.json").write_text(config_text)
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), str(tmp_path / "converted")])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and message in error, error
