"""🤗 Transformers' own model-test contract, for the three memlm models.

🤗 tests every model it ships with the mixins of its source tree (`ModelTesterMixin` in tests/test_modeling_common.py,
`GenerationTesterMixin` in tests/generation/test_utils.py, `ConfigTester` in tests/test_configuration_common.py),
which are not in its wheel. These are the checks of those mixins that apply to a decoder-only language model with a
recurrent memory, written here to the same contract (nothing copied), one tester per model as 🤗 writes one per
model. The settings are the ones 🤗 gives its own recurrent models (Mamba, RWKV, xLSTM):

- `has_attentions = False`: no `output_attentions` (the memory is not an attention matrix), so the attention checks
  are skipped, as for Mamba;
- the cache is the model's own: no `DynamicCache` format or static-cache checks; it rolls back (`crop`), so assisted
  and prompt-lookup decoding run (`_is_stateful = False`, unlike 🤗's Mamba and RWKV);
- no sequence-classification or question-answering heads, so `test_problem_types` and the head checks do not apply.

To run 🤗's own mixins instead: download transformers' source distribution of the installed version (`pip download
--no-deps --no-binary :all: transformers==X`), put its `tests/` folder on `PYTHONPATH`, and write a
`unittest.TestCase` per model with a `ModelTester` like the ones below (see tests/models/mamba/test_modeling_mamba.py
there).

A check that fails because of a defect being fixed goes in its tester's `known_defects` (marked `xfail(strict=True)`
naming the defect): when the fix lands it passes, strict turns that into a failure, and the entry must go. None is
listed today: `shift_labels`, retained hidden states and the whole-graph compile were fixed while these were written.
"""

import copy
import inspect
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

import memlm
from memlm.compat import (
    activation_checkpointing_disable,
    activation_checkpointing_enable,
    is_activation_checkpointing,
    output_cache,
)
from memlm.modeling.layers import SMALL_PROJECTIONS

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface


def ids_tensor(shape, vocab_size, generator):
    return torch.randint(0, vocab_size, shape, generator=generator)


def random_attention_mask(shape, generator):
    """Padding anywhere, as 🤗's testers draw it; the last token of every row is real."""
    mask = torch.randint(0, 2, shape, generator=generator)
    mask[:, -1] = 1
    return mask


class ModelTester:
    """Builds a tiny config and inputs (🤗's `ModelTester` classes)."""

    batch_size = 3
    seq_length = 7
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 64
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    config_class = None
    base_model_class = None
    causal_lm_class = None
    prompt_in_one_graph = False  # torch.compile(fullgraph=True) captures a forward over a prompt

    def config_fields(self) -> dict:
        return {}

    def get_config(self, **overrides):
        fields = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            **self.config_fields(),
            **overrides,
        }
        return self.config_class(**fields)

    def prepare_config_and_inputs_for_common(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        input_ids = ids_tensor((self.batch_size, self.seq_length), self.vocab_size, generator)
        attention_mask = random_attention_mask((self.batch_size, self.seq_length), generator)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class DeltaNetModelTester(ModelTester):
    config_class = memlm.DeltaNetConfig
    base_model_class = memlm.DeltaNetModel
    causal_lm_class = memlm.DeltaNetForCausalLM
    prompt_in_one_graph = True

    def get_config(self, **overrides):  # the flash-linear-attention layout: short convolutions and output norm
        fields = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                  "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                  "intermediate_size": self.intermediate_size, "pad_token_id": self.pad_token_id,
                  "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "chunk_size": 4}  # fmt: skip
        return memlm.DeltaNetConfig.from_preset("fla", **{**fields, **overrides})


class ExpireSpanModelTester(ModelTester):
    config_class = memlm.ExpireSpanConfig
    base_model_class = memlm.ExpireSpanModel
    causal_lm_class = memlm.ExpireSpanForCausalLM

    def config_fields(self) -> dict:
        return {"max_span": 8, "ramp": 2, "block_size": 4}


class FeedbackTransformerModelTester(ModelTester):
    config_class = memlm.FeedbackTransformerConfig
    base_model_class = memlm.FeedbackTransformerModel
    causal_lm_class = memlm.FeedbackTransformerForCausalLM

    def config_fields(self) -> dict:
        return {"memory_span": 6}


def _outputs_close(first, second, atol=1e-5, rtol=1e-5):
    """Every floating tensor of two outputs (nested tuples, dicts, model outputs) equal within tolerance."""
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        for key in first:
            _outputs_close(first[key], second[key], atol, rtol)
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second)
        for one, other in zip(first, second):
            _outputs_close(one, other, atol, rtol)
    elif isinstance(first, torch.Tensor) and first.is_floating_point():
        torch.testing.assert_close(first, second, atol=atol, rtol=rtol)


class TransformersContract:
    """The checks of ModelTesterMixin, GenerationTesterMixin and ConfigTester that apply to memlm's models."""

    model_tester: ModelTester
    has_attentions = False
    test_resize_embeddings = True
    # Defects being fixed elsewhere: test name (with its parameters, or without for all) → reason; those tests are
    # marked xfail(strict=True).
    known_defects: dict[str, str] = {}

    @pytest.fixture(autouse=True)
    def _mark_known_defects(self, request):
        reason = self.known_defects.get(request.node.name, self.known_defects.get(request.function.__name__))
        if reason is not None:
            request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))

    @property
    def all_model_classes(self):
        return (self.model_tester.base_model_class, self.model_tester.causal_lm_class)

    def _model(self, model_class, config):
        torch.manual_seed(0)
        return model_class(copy.deepcopy(config)).eval()

    # ---- ConfigTester ----

    def test_config_common_properties(self):
        config = self.model_tester.get_config()
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers"):
            assert hasattr(config, name), name
        for name, value in (("return_dict", False), ("output_hidden_states", True), ("tie_word_embeddings", True),
                            ("pad_token_id", 5), ("use_cache", False)):  # fmt: skip
            assert getattr(self.model_tester.get_config(**{name: value}), name) == value, name

    def test_config_round_trips(self, tmp_path):
        config = self.model_tester.get_config()
        from_string = self.model_tester.config_class.from_dict(json.loads(config.to_json_string()))
        assert from_string.to_dict() == config.to_dict()
        config.to_json_file(tmp_path / "config.json")
        assert self.model_tester.config_class.from_json_file(tmp_path / "config.json").to_dict() == config.to_dict()
        config.save_pretrained(tmp_path / "saved")
        assert self.model_tester.config_class.from_pretrained(tmp_path / "saved").to_dict() == config.to_dict()

    # ---- ModelTesterMixin ----

    def test_save_load(self, tmp_path):
        for model_class in self.all_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = self._model(model_class, config)
            with torch.no_grad():
                first = model(**inputs)[0]
            model.save_pretrained(tmp_path / model_class.__name__)
            assert (tmp_path / model_class.__name__ / "config.json").is_file()
            assert model.can_generate() == (tmp_path / model_class.__name__ / "generation_config.json").is_file()
            loaded = model_class.from_pretrained(tmp_path / model_class.__name__).eval()
            with torch.no_grad():
                second = loaded(**inputs)[0]
            torch.testing.assert_close(first, second)

    def test_determinism(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            with torch.no_grad():
                first, second = model(**inputs)[0], model(**inputs)[0]
            assert (first - second).abs().max() <= 1e-5

    def test_batching_equivalence(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_hidden_states = True
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            single = {key: value[:1] for key, value in inputs.items()}
            with torch.no_grad():
                batched, row = model(**inputs), model(**single)
            for key in row.keys():
                if key in ("cache", "past_key_values"):
                    continue
                values = row[key] if isinstance(row[key], tuple) else (row[key],)
                for batched_value, row_value in zip(batched[key] if isinstance(batched[key], tuple) else (batched[key],), values):  # fmt: skip
                    if isinstance(row_value, torch.Tensor) and row_value.is_floating_point() and row_value.dim():
                        assert torch.isfinite(batched_value).all() and torch.isfinite(row_value).all(), key
                        torch.testing.assert_close(batched_value[:1], row_value, atol=1e-5, rtol=1e-5, msg=key)

    def test_hidden_states_output(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        tester = self.model_tester
        for model_class in self.all_model_classes:
            for through_config in (False, True):
                run_config = copy.deepcopy(config)
                run_inputs = dict(inputs)
                if through_config:
                    run_config.output_hidden_states = True
                else:
                    run_inputs["output_hidden_states"] = True
                model = self._model(model_class, run_config)
                with torch.no_grad():
                    hidden_states = model(**run_inputs).hidden_states
                assert len(hidden_states) == tester.num_hidden_layers + 1
                for state in hidden_states:
                    assert list(state.shape) == [tester.batch_size, tester.seq_length, tester.hidden_size]

    def test_retain_grad_hidden_states_attentions(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_hidden_states = True
        model = self._model(self.all_model_classes[0], config)
        outputs = model(**inputs)
        hidden_states = outputs.hidden_states[0]
        hidden_states.retain_grad()
        outputs[0].flatten()[0].backward(retain_graph=True)
        assert hidden_states.grad is not None

    def test_retain_grad_every_hidden_state(self):
        """🤗's check above takes entry 0; every entry of `hidden_states` is part of the graph the same way."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self._model(self.model_tester.causal_lm_class, config)
        outputs = model(**inputs, output_hidden_states=True)
        for hidden_states in outputs.hidden_states:
            hidden_states.retain_grad()
        outputs.logits.sum().backward()
        assert [hidden_states.grad is not None for hidden_states in outputs.hidden_states] == [True] * len(
            outputs.hidden_states
        )

    def test_attention_outputs(self):
        if not self.has_attentions:
            pytest.skip("has_attentions=False: a recurrent memory returns no attention weights (as 🤗's Mamba)")

    def test_model_outputs_equivalence(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            for extra in ({}, {"output_hidden_states": True}):
                with torch.no_grad():
                    as_dict = model(**inputs, **extra, return_dict=True)
                    as_tuple = model(**inputs, **extra, return_dict=False)
                assert isinstance(as_tuple, tuple)
                expected = tuple(value for key, value in as_dict.items() if key not in ("cache", "past_key_values"))
                got = tuple(value for value in as_tuple if not isinstance(value, memlm_caches()))
                _outputs_close(expected, got, atol=0, rtol=0)

    def test_inputs_embeds_matches_input_ids(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            with torch.no_grad():
                from_ids = model(**inputs)[0]
                from_embeds = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])[0]
            torch.testing.assert_close(from_embeds, from_ids)

    def test_causal_lm_loss_honors_shift_labels(self):
        """With `shift_labels` given, the loss follows them and ignores `labels`."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.use_cache = False
        model = self._model(self.model_tester.causal_lm_class, config)
        shape = inputs["input_ids"].shape

        def targets(seed):
            return torch.randint(2, shape, generator=torch.Generator().manual_seed(seed))

        def loss(labels, shift_labels):
            with torch.no_grad():
                return model(**inputs, labels=labels, shift_labels=shift_labels).loss

        reference = loss(targets(0), targets(1))
        assert not torch.allclose(loss(targets(0), targets(2)), reference), "the loss ignores shift_labels"
        torch.testing.assert_close(loss(targets(3), targets(1)), reference, msg="labels moved the loss")

    def _trainable_gradients(self, model, inputs):
        model.train()
        model.zero_grad()
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        return loss.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}

    def test_training(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self._model(self.model_tester.causal_lm_class, config)
        loss, gradients = self._trainable_gradients(model, inputs)
        assert torch.isfinite(loss)
        assert all(gradient is not None for gradient in gradients.values()), [n for n, g in gradients.items() if g is None]  # fmt: skip

    @pytest.mark.parametrize("use_reentrant", [None, True, False])
    def test_training_gradient_checkpointing(self, use_reentrant):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self._model(self.model_tester.causal_lm_class, config)
        assert model.supports_gradient_checkpointing
        expected_loss, expected = self._trainable_gradients(model, inputs)
        kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
        activation_checkpointing_enable(model, kwargs)
        loss, gradients = self._trainable_gradients(model, inputs)
        torch.testing.assert_close(loss, expected_loss)
        for name, gradient in gradients.items():
            assert gradient is not None, name
            torch.testing.assert_close(gradient, expected[name], atol=1e-6, rtol=1e-5, msg=name)

    def test_activation_checkpointing_enable_disable(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            assert not is_activation_checkpointing(model)
            activation_checkpointing_enable(model)
            assert is_activation_checkpointing(model)
            flagged = [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]
            assert flagged and all(module.gradient_checkpointing for module in flagged)
            activation_checkpointing_disable(model)
            assert not is_activation_checkpointing(model)
            assert not any(module.gradient_checkpointing for module in flagged)

    def test_enable_input_require_grads(self):
        """What PEFT relies on: with every weight frozen, the embedding output still requires a gradient."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_hidden_states = True
        model = self._model(self.model_tester.causal_lm_class, config)
        model.requires_grad_(False)
        model.enable_input_require_grads()
        assert model(**inputs).hidden_states[0].requires_grad
        model.disable_input_require_grads()
        assert not model(**inputs).hidden_states[0].requires_grad

    def test_resize_tokens_embeddings(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        vocab_size = config.vocab_size
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            kind = type(model.get_input_embeddings())
            before = model.resize_token_embeddings(vocab_size).weight.clone()
            grown = model.resize_token_embeddings(vocab_size + 10)
            assert model.config.vocab_size == vocab_size + 10 and grown.weight.shape[0] == vocab_size + 10
            assert type(grown) is kind
            # New rows are drawn around the mean of the old ones (🤗's default).
            torch.testing.assert_close(grown.weight[-10:].mean(0), grown.weight[:-10].mean(0), atol=1e-3, rtol=1e-3)
            ids = inputs["input_ids"].clone()
            ids[:, -2] = vocab_size + 9
            with torch.no_grad():
                output = model(input_ids=ids, attention_mask=inputs["attention_mask"])
            if model_class is self.model_tester.causal_lm_class:
                assert output.logits.shape[-1] == vocab_size + 10
            shrunk = model.resize_token_embeddings(vocab_size - 15)
            assert model.config.vocab_size == vocab_size - 15 and shrunk.weight.shape[0] == vocab_size - 15
            torch.testing.assert_close(shrunk.weight, before[: vocab_size - 15])
            with torch.no_grad():
                model(input_ids=ids.clamp(max=vocab_size - 16), attention_mask=inputs["attention_mask"])
            padded = model.resize_token_embeddings(vocab_size + 13, pad_to_multiple_of=64)
            assert padded.weight.shape[0] % 64 == 0 and padded.weight.shape[0] >= vocab_size + 13
            assert model.config.vocab_size == padded.weight.shape[0]

    def test_resize_embeddings_untied(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.tie_word_embeddings = False
        model = self._model(self.model_tester.causal_lm_class, config)
        model.resize_token_embeddings(config.vocab_size + 10)
        assert model.get_output_embeddings().weight.shape[0] == config.vocab_size + 10
        assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        with torch.no_grad():
            assert model(**inputs).logits.shape[-1] == config.vocab_size + 10
        model.resize_token_embeddings(config.vocab_size - 15)
        assert model.get_output_embeddings().weight.shape[0] == config.vocab_size - 15

    def test_model_get_set_embeddings(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
            replacement = torch.nn.Embedding(10, config.hidden_size)
            model.set_input_embeddings(replacement)
            assert model.get_input_embeddings() is replacement
            output = model.get_output_embeddings()
            assert output is None or isinstance(output, torch.nn.Linear)

    def test_model_main_input_name_and_base_model_prefix(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            assert model_class.main_input_name == "input_ids"
            assert list(inspect.signature(model_class.forward).parameters)[1] == "input_ids"
        model = self._model(self.model_tester.causal_lm_class, config)
        assert isinstance(getattr(model, model.base_model_prefix), self.model_tester.base_model_class)
        assert model.base_model is getattr(model, model.base_model_prefix)

    def test_tied_weights_keys(self, tmp_path):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.tie_word_embeddings = True
        model = self._model(self.model_tester.causal_lm_class, config)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        model.save_pretrained(tmp_path)
        loaded, info = self.model_tester.causal_lm_class.from_pretrained(tmp_path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(**inputs).logits, model(**inputs).logits)

    def test_load_save_without_tied_weights(self, tmp_path):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        config.tie_word_embeddings = False
        model = self._model(self.model_tester.causal_lm_class, config)
        with torch.no_grad():
            model.get_output_embeddings().weight.add_(1.0)
        model.save_pretrained(tmp_path)
        loaded, info = self.model_tester.causal_lm_class.from_pretrained(tmp_path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        for name, parameter in model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], parameter, atol=0, rtol=0, msg=name)
        assert loaded.get_output_embeddings().weight.data_ptr() != loaded.get_input_embeddings().weight.data_ptr()

    def test_can_use_safetensors_and_torch_save_load(self, tmp_path):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = self._model(model_class, config)
            folder = tmp_path / model_class.__name__
            model.save_pretrained(folder)
            assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
            loaded = model_class.from_pretrained(folder)
            torch.save(model.state_dict(), folder / "weights.pt")
            again = model_class(copy.deepcopy(config))
            again.load_state_dict(torch.load(folder / "weights.pt", weights_only=True))
            for name, parameter in model.state_dict().items():
                torch.testing.assert_close(loaded.state_dict()[name], parameter, atol=0, rtol=0, msg=name)
                torch.testing.assert_close(again.state_dict()[name], parameter, atol=0, rtol=0, msg=name)

    def test_base_model_prefix_loads_base_weights(self, tmp_path):
        """A saved base model loads into the causal-LM class (only the head is new) and back."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.tie_word_embeddings = False
        base = self._model(self.model_tester.base_model_class, config)
        base.save_pretrained(tmp_path / "base")
        causal, info = self.model_tester.causal_lm_class.from_pretrained(tmp_path / "base", output_loading_info=True)
        assert set(info["missing_keys"]) == {"lm_head.weight"} and not info["unexpected_keys"], info
        with torch.no_grad():
            torch.testing.assert_close(causal.eval().model(**inputs)[0], base(**inputs)[0])
        causal.save_pretrained(tmp_path / "causal")
        base_again, info = self.model_tester.base_model_class.from_pretrained(tmp_path / "causal", output_loading_info=True)  # fmt: skip
        assert not info["missing_keys"], info
        with torch.no_grad():
            torch.testing.assert_close(base_again.eval()(**inputs)[0], base(**inputs)[0])

    def test_bc_torch_dtype(self, tmp_path):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model_class = self.model_tester.causal_lm_class
        self._model(model_class, config).save_pretrained(tmp_path)
        for dtype in ("float16", "bfloat16", "float32", "auto", torch.float16, torch.bfloat16):
            with_dtype = model_class.from_pretrained(tmp_path, dtype=dtype)
            with_torch_dtype = model_class.from_pretrained(tmp_path, torch_dtype=dtype)
            expected = torch.float32 if dtype == "auto" else getattr(torch, dtype) if isinstance(dtype, str) else dtype
            for (name, first), (_, second) in zip(with_dtype.named_parameters(), with_torch_dtype.named_parameters()):
                assert first.dtype == second.dtype, name
                torch.testing.assert_close(first, second, msg=name)
            assert with_dtype.dtype == expected

    def test_from_pretrained_with_a_different_dtype_runs(self, tmp_path):
        """Loaded in another dtype, the model runs and gives about the same logits. `_keep_in_fp32_modules`
        (`layers.SMALL_PROJECTIONS`: DeltaNet's β, Expire-Span's span predictor), as 🤗 reads it: float32 in a float16
        model, which converts their inputs; other dtypes load them as the rest."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model_class = self.model_tester.causal_lm_class
        model = self._model(model_class, config)
        model.save_pretrained(tmp_path)
        with torch.no_grad():
            expected = model(**inputs).logits
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            loaded = model_class.from_pretrained(tmp_path, dtype=dtype).eval()
            kept = {name for name, _ in loaded.named_parameters() if name.split(".")[-2] in SMALL_PROJECTIONS}
            assert bool(kept) == any(name in str(loaded) for name in SMALL_PROJECTIONS)
            for name, parameter in loaded.named_parameters():
                assert parameter.dtype == (torch.float32 if name in kept and dtype == torch.float16 else dtype), name
            with torch.no_grad():
                logits = loaded(**inputs).logits
            assert logits.dtype == dtype
            tolerance = 1e-5 if dtype == torch.float64 else 1e-1
            torch.testing.assert_close(logits.float(), expected, atol=tolerance, rtol=tolerance)

    def test_load_with_mismatched_shapes(self, tmp_path):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model_class = self.model_tester.causal_lm_class
        self._model(model_class, config).save_pretrained(tmp_path)
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            model_class.from_pretrained(tmp_path, vocab_size=config.vocab_size + 5)
        model = model_class.from_pretrained(tmp_path, vocab_size=config.vocab_size + 5, ignore_mismatched_sizes=True)
        with torch.no_grad():
            assert model.eval()(**inputs).logits.shape[-1] == config.vocab_size + 5

    def test_can_be_initialized_on_meta(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            with torch.device("meta"):
                model = model_class(copy.deepcopy(config))
            assert all(parameter.device.type == "meta" for parameter in model.parameters())

    @pytest.mark.parametrize("call", ["forward", "decoding_step"])
    def test_torch_compile_fullgraph(self, call):
        """One graph, no break, for one decoding step as `generate` makes it (cache and attention mask): what 🤗's
        compile checks need (they run for models declaring `_can_compile_fullgraph`); for DeltaNet, for a forward over
        a prompt too. The Feedback Transformer and Expire-Span run a prompt's loop over its steps or blocks outside the
        graph (unrolled, it took minutes to compile): compiled without fullgraph, a prompt gives the eager logits;
        with it, the error says why. Compiled with the eager backend: graph capture is what is checked, not code
        generation."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self._model(self.model_tester.causal_lm_class, config)
        input_ids = inputs["input_ids"]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            if call == "forward":
                if not self.model_tester.prompt_in_one_graph:
                    with pytest.raises(Exception, match="runs a prompt's loop over its steps or blocks outside"):
                        compiled(input_ids)
                    torch._dynamo.reset()
                    compiled = torch.compile(model, backend="eager")
                torch.testing.assert_close(compiled(input_ids).logits, model(input_ids).logits)
                return
            mask = torch.ones(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.long)
            expected = model(input_ids[:, :1], attention_mask=mask, cache=model(input_ids).cache)
            got = compiled(input_ids[:, :1], attention_mask=mask, cache=model(input_ids).cache)
        torch.testing.assert_close(got.logits, expected.logits)

    # ---- GenerationTesterMixin ----

    def _generation_model(self, **overrides):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for key, value in overrides.items():
            setattr(config, key, value)
        model = self._model(self.model_tester.causal_lm_class, config)
        model.generation_config = GenerationConfig(pad_token_id=config.pad_token_id, eos_token_id=None)
        return model, inputs

    def test_greedy_generate_equals_the_argmax_loop(self):
        model, inputs = self._generation_model()
        prompt = inputs["input_ids"]
        output = model.generate(prompt, max_new_tokens=4, do_sample=False)
        assert output.shape == (prompt.shape[0], prompt.shape[1] + 4)
        tokens = prompt
        with torch.no_grad():
            for _ in range(4):  # no cache: the whole sequence again each step
                tokens = torch.cat([tokens, model(tokens, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(output, tokens)

    def test_greedy_generate_dict_outputs(self):
        model, inputs = self._generation_model()
        tester = self.model_tester
        output = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=3,
                                do_sample=False, return_dict_in_generate=True, output_scores=True,
                                output_logits=True, output_hidden_states=True)  # fmt: skip
        assert output.sequences.shape == (tester.batch_size, tester.seq_length + 3)
        assert len(output.scores) == len(output.logits) == len(output.hidden_states) == 3
        for step, scores in enumerate(output.scores):
            assert scores.shape == (tester.batch_size, tester.vocab_size)
            assert torch.equal(scores.argmax(-1), output.sequences[:, tester.seq_length + step])
        assert len(output.hidden_states[0]) == tester.num_hidden_layers + 1
        assert output.hidden_states[0][0].shape == (tester.batch_size, tester.seq_length, tester.hidden_size)
        assert output.hidden_states[1][0].shape == (tester.batch_size, 1, tester.hidden_size)

    def test_sample_generate_is_reproducible(self):
        model, inputs = self._generation_model()
        outputs = []
        for _ in range(2):
            torch.manual_seed(5)
            outputs.append(model.generate(**inputs, max_new_tokens=5, do_sample=True, top_k=10))
        assert torch.equal(outputs[0], outputs[1])

    def test_beam_search_generate(self):
        model, inputs = self._generation_model()
        cached = model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
        uncached = model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False, use_cache=False)
        assert cached.shape == (self.model_tester.batch_size, self.model_tester.seq_length + 3)
        assert torch.equal(cached, uncached)

    def test_generate_continue_from_cache(self):
        model, inputs = self._generation_model()
        prompt = inputs["input_ids"]
        whole = model.generate(prompt, max_new_tokens=6, do_sample=False)
        first = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        rest = model.generate(first.sequences, cache=output_cache(first), max_new_tokens=3,
                              do_sample=False)  # fmt: skip
        assert torch.equal(rest, whole)

    def test_left_padding_compatibility(self):
        model, inputs = self._generation_model()
        input_ids = inputs["input_ids"]
        with torch.no_grad():
            expected = model(input_ids).logits[:, -1]
            padded_ids = torch.cat([torch.full((input_ids.shape[0], 4), self.model_tester.pad_token_id), input_ids], 1)
            mask = torch.cat([torch.zeros(input_ids.shape[0], 4, dtype=torch.long), torch.ones_like(input_ids)], 1)
            padded = model(padded_ids, attention_mask=mask).logits[:, -1]
        torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)

    def test_batched_generation_equals_single(self):
        """A left-padded batch generates, row by row, what each prompt generates alone."""
        model, _ = self._generation_model()
        generator = torch.Generator().manual_seed(1)
        prompts = [ids_tensor((length,), self.model_tester.vocab_size - 3, generator) + 3 for length in (7, 4, 2)]
        width = max(len(prompt) for prompt in prompts)
        pad = self.model_tester.pad_token_id
        batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
        mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
        batched = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt[None], max_new_tokens=5, do_sample=False)
            assert torch.equal(batched[row, width:], alone[0, len(prompt) :]), row

    def test_generate_from_inputs_embeds(self):
        model, inputs = self._generation_model()
        input_ids = inputs["input_ids"]
        from_ids = model.generate(input_ids, max_new_tokens=4, do_sample=False)
        embeds = model.get_input_embeddings()(input_ids)
        from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
        assert torch.equal(from_embeds, from_ids[:, input_ids.shape[1] :])

    def _printable_generation_model(self):
        """A model that generates only printable bytes ('!'..'b', below the tester's vocabulary size of 99), so that
        any generated token is a one-character stop string."""
        model, _ = self._generation_model()
        model.generation_config.suppress_tokens = list(range(ord("!")))
        model.generation_config.do_sample = False
        return model

    def test_generate_stops_at_a_stop_string(self, tokenizer):
        model = self._printable_generation_model()
        prompt = tokenizer("MEMORY", return_tensors="pt").input_ids
        free = model.generate(prompt, max_new_tokens=8)[0, prompt.shape[1] :]
        stop = tokenizer.decode(free[3:4])
        end = int((free == free[3]).nonzero()[0]) + 1  # the first time the stop string is generated
        stopped = model.generate(prompt, max_new_tokens=8, stop_strings=[stop], tokenizer=tokenizer)
        assert torch.equal(stopped[0, prompt.shape[1] :], free[:end])

    def test_pipeline_stops_at_a_stop_sequence(self, tokenizer):
        model = self._printable_generation_model()
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        free = generator("MEMORY", max_new_tokens=8, return_full_text=False)[0]["generated_text"]
        assert len(free) == 8
        stopped = generator("MEMORY", max_new_tokens=8, return_full_text=False, stop_sequence=free[3])
        assert stopped[0]["generated_text"] == free[: free.index(free[3]) + 1]

    def test_forward_refuses_what_generate_keeps(self, tokenizer):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self._model(self.model_tester.causal_lm_class, config)
        with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): tokenizer\."):
            model(inputs["input_ids"], tokenizer=tokenizer)

    def test_continuous_batching_is_declined(self):
        """🤗's continuous batching needs a paged key-value cache: the entry point is absent (`transformers serve
        --continuous-batching` then falls back to generate), and generate_batch refuses at once."""
        model, inputs = self._generation_model()
        assert not hasattr(model, "init_continuous_batching")
        with pytest.raises(AttributeError, match="init_continuous_batching"):
            model.generate_batch(inputs["input_ids"].tolist(), generation_config=GenerationConfig(max_new_tokens=2))

    def test_assisted_decoding_matches_greedy_search(self):
        """🤗's check: assisted decoding with the model as its own assistant, and prompt-lookup decoding, give greedy
        search's tokens and scores (batch 1, as 🤗 allows; the row's padding anywhere, as the testers draw it)."""
        model, inputs = self._generation_model()
        prompt, mask = inputs["input_ids"][:1], inputs["attention_mask"][:1]
        settings = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True,
                    "output_scores": True}  # fmt: skip
        greedy = model.generate(prompt, **settings)
        for speculation in ({"assistant_model": model}, {"prompt_lookup_num_tokens": 2}):
            assisted = model.generate(prompt, **settings, **speculation)
            assert torch.equal(assisted.sequences, greedy.sequences)
            _outputs_close(assisted.scores, greedy.scores)

    def test_past_key_values_format(self):
        pytest.skip("the model's own recurrent cache, not a DynamicCache of keys and values (as 🤗's Mamba)")


def memlm_caches():
    return (memlm.DeltaNetCache, memlm.ExpireSpanCache, memlm.FeedbackCache)


class TestDeltaNetContract(TransformersContract):
    model_tester = DeltaNetModelTester()


class TestExpireSpanContract(TransformersContract):
    model_tester = ExpireSpanModelTester()


class TestFeedbackTransformerContract(TransformersContract):
    model_tester = FeedbackTransformerModelTester()


def test_the_testers_cover_every_memlm_model():
    """One tester per model class memlm registers with AutoModelForCausalLM."""
    covered = {tester.model_tester.causal_lm_class for tester in TransformersContract.__subclasses__()}
    registered = {
        model_class
        for config_class, model_class in AutoModelForCausalLM._model_mapping._extra_content.items()
        if config_class.__module__.startswith("memlm.")
    }
    assert covered == registered
