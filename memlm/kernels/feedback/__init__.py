"""The Feedback Transformer's recurrence over time steps (SPEC §3): one public function.

Fan et al. (ICLR 2021), *Addressing Some Limitations of Transformers with Feedback Memory*, Sec. 3, Eq. 1: at step t
every layer attends over the memories m_{t−τ} … m_{t−1}, and m_t = Σ_l softmax(w)_l · x_t^l mixes all layers of step
t, so the steps run one after the other. `reference.py` writes that loop plainly; :func:`feedback_recurrence`
validates its inputs and dispatches on the backend (see :func:`memlm.kernels.resolve_backend`):

- ``"reference"``: `reference.py`, the memory as Python lists and autograd through every step;
- ``"torch"`` (and ``"triton"``/``"fla"``, which have no kernel of their own for this recurrence): the memory in
  preallocated buffers (`tape.py`): without gradients the cache's ring of up to τ slots, written in place; in training a
  tape of all steps, and the hand-written backward of `through_time.py` (`_ThroughTime`: every layout, the papers'
  included), or autograd through every step where that backward does not know the forward (float16/bfloat16,
  autocast, per-step outputs kept, adapters, hooks: see `through_time.covers`). The papers' options the ring does
  not hold (keys and values recomputed from carried hidden states, the adaptive span, dropout on the attention
  weights: the model's `needs_tape`) run on the ring without gradients but for a trimmed adaptive span (whose window
  is shorter), which runs on the tape.

The step itself (layers, memory mix, projections) is the model's: `model.step`, in `modeling_feedback_transformer.py`,
with what it adds to its attention scores in `scores.py`;
with the config's `compile_step`, its pure functions run through `torch.compile` where no autograd is needed
(`compiled.py`).
"""

import torch

from memlm.kernels import resolve_backend

from .reference import feedback_recurrence_reference
from .tape import ProjectedSet, _RingStore, _Tape, stacked_memories
from .through_time import DeferredWeightGradients, _ThroughTime, compiled_step_applies, covers, recurrent_parameters

__all__ = ["feedback_recurrence", "feedback_recurrence_reference"]


def _check_inputs(model, inputs_embeds, positions, valid, cache_layers, next_positions, padding_steps) -> None:
    """Raise ``ValueError`` naming the offending argument and its shape if the inputs do not fit together."""
    if (
        not isinstance(inputs_embeds, torch.Tensor)
        or inputs_embeds.dim() != 3
        or not inputs_embeds.is_floating_point()
    ):
        shape = tuple(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise ValueError(f"inputs_embeds must be a floating-point tensor (batch, tokens, hidden), got {shape}.")
    batch_size, length = inputs_embeds.shape[:2]
    if length == 0:
        raise ValueError(
            f"the sequences must hold at least one token, got inputs_embeds {tuple(inputs_embeds.shape)}."
        )
    for name, tensor in (("positions", positions), ("valid", valid)):
        if tuple(tensor.shape) != (batch_size, length):
            raise ValueError(
                f"{name} must have shape (batch, tokens) = {(batch_size, length)}, got {tuple(tensor.shape)}."
            )
    if tuple(next_positions.shape) != (batch_size,):
        raise ValueError(
            f"next_positions must have shape (batch,) = {(batch_size,)}, got {tuple(next_positions.shape)}."
        )
    if len(cache_layers) != model.config.memory_groups:
        raise ValueError(
            f"cache_layers must hold one key/value set per memory group ({model.config.memory_groups}), got "
            f"{len(cache_layers)}."
        )
    if isinstance(padding_steps, bool) or not isinstance(padding_steps, int) or padding_steps < 0:
        raise ValueError(f"padding_steps must be a non-negative integer, got {padding_steps!r}.")


def feedback_recurrence(
    model,
    inputs_embeds: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    cache_layers: list,
    next_positions: torch.Tensor,
    *,
    padding_steps: int = 0,
    keep_states: bool = False,
    backend: str | None = None,
    carry_from: torch.Tensor | None = None,
):
    """Run ``model.step`` over the T positions of a batch, with the memory carried in ``cache_layers``.

    Args:
        model: the `FeedbackTransformerModel` whose `step` runs one position (and whose layers the hand-written
            backward differentiates).
        inputs_embeds: (B, T, D) token embeddings, padding first in each row.
        positions: (B, T) each token's position (counted from the row's first real token); −1 for padding.
        valid: (B, T) False for padding, which writes nothing into the memory.
        cache_layers: the cache's key/value sets (one, or one per layer): the memory entering the sequence. Without
            gradients (fast path) they are laid out as a ring of up to τ slots (as many as the context needs) and
            written in place.
        next_positions: (B,) the position of each row's next real token before this call.
        padding_steps: the most padding tokens of a row; the training tape widens its windows by it.
        keep_states: also return every layer's output at every step (for ``output_hidden_states``).
        backend: ``"torch"``, ``"triton"``, ``"fla"`` (the last two run as ``"torch"``) or ``"reference"``; ``None``
            reads ``$MEMLM_KERNELS``.
        carry_from: (B,) where the memory returned as a window must stay visible from (default: each row's next real
            token after this call): a cache that may roll tokens back (speculative decoding) carries what its
            earliest next token sees. The ring is written in place whatever it says.

    Returns:
        The top layer's outputs (B, T, D); the list of every step's layer outputs (empty unless ``keep_states``, or
        always filled by the reference); and the memory the next call should carry, keys and values (G, B, H, W, d),
        positions and validity (B, W), or ``None`` when the ring in ``cache_layers`` was written in place.
    """
    _check_inputs(model, inputs_embeds, positions, valid, cache_layers, next_positions, padding_steps)
    backend = resolve_backend(backend, inputs_embeds.device, operation="feedback")
    config = model.config
    # The official layout's options (keys and values recomputed from hidden states, the adaptive span, dropout on
    # the attention weights) run on the ring without gradients (the model's `_starting_memory` puts the recomputed
    # memory into the cache's layers) and on the tape with them; a forward that may be rolled back (`carry_from`)
    # through the reference. A trimmed adaptive span runs on the tape without gradients too: the window it carries
    # holds only the memories some layer still reads, fewer than a ring's τ slots (but for compiled decoding).
    on_tape = getattr(model, "needs_tape", False)
    if backend == "reference" or (on_tape and carry_from is not None):
        return feedback_recurrence_reference(model.step, inputs_embeds, positions, valid, cache_layers,
                                             next_positions, config.memory_span, carry_from)  # fmt: skip
    training = torch.is_grad_enabled() and (
        inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in model.parameters())
    )
    # (A compiled step's ring holds τ slots from the start: `full_ring`; a trimmed window reads fewer of them.)
    ring = not training and (
        not getattr(model, "trims_adaptive_span", False) or getattr(cache_layers[0], "full_ring", False)
    )
    if ring:
        store = _RingStore(cache_layers, next_positions, config, inputs_embeds, positions)
    elif training and covers(model, inputs_embeds, keep_states):
        # The hand-written backward: the tape filled without autograd. Memories projected from hidden states in this
        # forward (carried ones, or the zero initial memory: `ProjectedMemories`) are projected into it without
        # autograd too, and their projection differentiated by hand; other memories that carry gradients get theirs.
        with torch.no_grad():
            store = _Tape(cache_layers, inputs_embeds.shape[1], config, inputs_embeds, padding_steps)
        projected = cache_layers[0].memories if isinstance(cache_layers[0], ProjectedSet) else None
        prefix_keys = prefix_values = None
        if projected is None and cache_layers[0].keys is not None and (
            cache_layers[0].keys.requires_grad or cache_layers[0].values.requires_grad
        ):  # fmt: skip
            prefix_keys, prefix_values = stacked_memories(cache_layers)
        names, parameters = zip(*recurrent_parameters(model))
        top = _ThroughTime.apply(model, store, inputs_embeds, positions, valid, prefix_keys, prefix_values, projected,
                                 names, *parameters)  # fmt: skip
        store.release()
        return top, [], store.last_memories()
    else:
        store = _Tape(cache_layers, inputs_embeds.shape[1], config, inputs_embeds, padding_steps)
    if training and DeferredWeightGradients.applies(model, inputs_embeds):
        model.deferred = DeferredWeightGradients(model, inputs_embeds.shape[0])
    try:
        return _step_loop(model, inputs_embeds, positions, valid, store, keep_states, not ring)
    finally:
        if model.deferred is not None:
            model.deferred.release()
        model.deferred = None
        if not ring:
            store.release()


def _step_loop(model, inputs_embeds, positions, valid, store, keep_states: bool, leaves_window: bool):
    """`model.step` over the positions, with autograd where gradients are needed."""
    outputs, all_states = [], []
    compiled = compiled_step_applies(model, inputs_embeds)  # `compile_step`, without autograd
    # unbind once: indexing step by step would give each step's gradient the size of the whole input.
    for step, (embeddings, step_positions, step_valid) in enumerate(
        zip(inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1))
    ):
        hidden_states, states = model.step(embeddings, step_positions, step_valid, store, step, compiled=compiled)
        outputs.append(hidden_states)
        if keep_states:
            all_states.append(states)
    return torch.stack(outputs, dim=1), all_states, store.last_memories() if leaves_window else None
