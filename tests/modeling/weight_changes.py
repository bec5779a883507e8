"""A check shared by the layout tests of the models whose memories are made from hidden states with the current
weights (Expire-Span's `recompute_memory`, the Feedback Transformer's carried hidden states)."""

import copy
import sys

import torch

import memlm.modeling.memory as memory
from memlm.compat import CACHE_NAME, output_cache


def assert_generate_walks_once_and_sees_a_change(model, prompt: torch.Tensor, monkeypatch):
    """Inside `generate`, whose steps change no weight, the model's weights are walked (`weights_version`) until a step
    finds the cache's memories made with them, not at every step: as many walks for 12 new tokens as for 3. The next
    call, continuing the cache after an optimizer step, walks them again: it makes the carried memories anew with the
    new weights, as a call whose cache forgot the weights does, and not as one that takes the old memories as
    current."""
    walks, walk = [], memory.weights_version
    for name, module in list(sys.modules.items()):  # counted wherever memlm imported it
        if name.startswith("memlm") and getattr(module, "weights_version", None) is walk:
            monkeypatch.setattr(module, "weights_version", lambda model: walks.append(model) or walk(model))

    def generate(tokens, new_tokens, cache=None):
        continued = {} if cache is None else {CACHE_NAME: cache}  # (the name the installed 🤗's `generate` reads)
        return model.generate(tokens, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, **continued)  # fmt: skip

    counts = []
    for new_tokens in (3, 12):
        walks.clear()
        first = generate(prompt, new_tokens)
        counts.append(len(walks))
    assert counts[0] == counts[1] <= 2  # the prompt's forward and the first step
    with torch.no_grad():
        for parameter in model.model.layers[0].parameters():  # an optimizer step, in place
            parameter.add_(torch.randn_like(parameter) * 0.1)
    cache = output_cache(first)
    forgot, stale = copy.deepcopy(cache), copy.deepcopy(cache)
    forgot.weights_version = None  # every carried memory made anew
    stale.weights_version = walk(model.model)  # the old memories taken as current
    continued = generate(first.sequences, 4, cache)
    expected = generate(first.sequences, 4, forgot)
    kept_stale = generate(first.sequences, 4, stale)
    assert torch.equal(continued.sequences, expected.sequences)
    assert max((ours - theirs).abs().max() for ours, theirs in zip(continued.logits, expected.logits)) < 1e-12
    assert max((ours - theirs).abs().max() for ours, theirs in zip(kept_stale.logits, expected.logits)) > 1e-6
