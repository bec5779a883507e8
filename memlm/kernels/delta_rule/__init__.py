"""The delta rule and the sum rule of DeltaNet (SPEC §1): one public function per rule.

Schlag, Irie & Schmidhuber (2021), *Linear Transformers Are Secretly Fast Weight Programmers*.
Per head and step t, with the memory ``S ∈ R^{d_k×d_v}``:

- delta rule (Sec. 4.2, Eqs. 20-25): ``v̄_t = Sᵀ k_t``, ``S ← S + β_t k_t (v_t − v̄_t)ᵀ``, ``o_t = Sᵀ q_t``;
- sum rule (Eqs. 17-19, without the attention normaliser): ``S ← S + k_t v_tᵀ``, ``o_t = Sᵀ q_t``.

:func:`delta_rule` and :func:`sum_rule` validate their inputs and dispatch on the backend (see
:func:`memlm.kernels.resolve_backend`): ``"torch"`` runs the chunkwise implementation of ``chunk.py``
(or, for a single token, the O(1) decoding step), ``"triton"`` the Triton kernels of ``triton_chunk.py`` and
``triton_recurrent.py``, ``"fla"`` flash-linear-attention's kernels through ``flash_linear_attention.py`` (the delta
rule only; the sum rule has no FLA kernel and runs as with ``"triton"``), ``"reference"`` the recurrent loops of
``reference.py``. Queries are used as given: scaling and normalising them is the caller's job.
"""

import torch

from memlm.kernels import check_triton_device, resolve_backend, sums_are_finite

from .chunk import delta_rule_chunk, delta_rule_step, sum_rule_chunk, sum_rule_step
from .reference import delta_rule_reference, sum_rule_reference

__all__ = ["delta_rule", "delta_rule_reference", "sum_rule", "sum_rule_reference"]


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> list[int] | None:
    """Raise ``ValueError`` naming the offending argument and its shape if the inputs do not fit together."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a 4-dimensional tensor (batch, heads, tokens, width), got {shape}.")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}.")
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    if query.shape != key.shape:
        raise ValueError(
            f"query and key must have the same shape (batch, heads, tokens, key width), got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}."
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must share (batch, heads, tokens) with key, got value {tuple(value.shape)} and key {tuple(key.shape)}."
        )
    if length == 0:
        raise ValueError(f"the sequences must hold at least one token, got key {tuple(key.shape)}.")
    if beta is not None and beta.shape != (batch_size, num_heads, length):
        raise ValueError(
            f"beta must have shape (batch, heads, tokens) = {(batch_size, num_heads, length)}, got {tuple(beta.shape)}."
        )
    expected_state = (batch_size, num_heads, key_dim, value_dim)
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-dimensional integer tensor of offsets, got {cu_seqlens!r}.")
        offsets = _host_offsets(cu_seqlens, cu_seqlens_cpu)
        if batch_size != 1 or offsets[0] != 0 or offsets[-1] != length or offsets != sorted(offsets):
            raise ValueError(
                f"with cu_seqlens the inputs hold the sequences back to back in one row: batch size 1 and offsets "
                f"rising from 0 to the {length} tokens; got batch size {batch_size} and cu_seqlens {offsets}."
            )
        expected_state = (len(offsets) - 1, num_heads, key_dim, value_dim)
    if initial_state is not None and initial_state.shape != expected_state:
        raise ValueError(
            f"initial_state must have shape (batch, heads, key width, value width) = {expected_state}, "
            f"got {tuple(initial_state.shape)}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}.")
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens: give cu_seqlens (on the inputs' device) too.")
    return offsets if cu_seqlens is not None else None


def _host_offsets(cu_seqlens: torch.Tensor, cu_seqlens_cpu) -> list[int]:
    """The packed sequences' offsets as a list: from the host copy when the caller has one (no device read),
    else read back from `cu_seqlens` once."""
    if cu_seqlens_cpu is None:
        return cu_seqlens.tolist()
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.dim() != 1 or cu_seqlens_cpu.is_floating_point():
            raise ValueError(
                f"cu_seqlens_cpu must be a 1-dimensional integer CPU tensor or a list of ints, got {cu_seqlens_cpu!r}."
            )
        cu_seqlens_cpu = cu_seqlens_cpu.tolist()
    if not isinstance(cu_seqlens_cpu, (list, tuple)) or not all(
        isinstance(offset, int) and not isinstance(offset, bool) for offset in cu_seqlens_cpu
    ):
        raise ValueError(f"cu_seqlens_cpu must be a list of ints or an integer CPU tensor, got {cu_seqlens_cpu!r}.")
    if len(cu_seqlens_cpu) != cu_seqlens.numel():
        raise ValueError(
            f"cu_seqlens_cpu must hold the same offsets as cu_seqlens: got {len(cu_seqlens_cpu)} host offsets for "
            f"{cu_seqlens.numel()} in cu_seqlens."
        )
    return list(cu_seqlens_cpu)


def _needs_gradient(*tensors) -> bool:
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def _per_sequence(offsets, output_final_state, query, key, value, beta, initial_state, run):
    """Run `run(query, key, value, beta, initial_state)` on each packed sequence (`offsets`, a list) and put the
    results back together."""
    outputs, states = [], []
    for index, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        state = None if initial_state is None else initial_state[index : index + 1]
        if end == start:  # an empty sequence: no output, its state passes through
            states.append(state)
            continue
        pieces = [tensor[:, :, start:end] if tensor is not None else None for tensor in (query, key, value, beta)]
        output, final = run(*pieces, state)
        outputs.append(output)
        states.append(final)
    output = torch.cat(outputs, dim=2) if outputs else value.new_zeros(value.shape)
    if not output_final_state:
        return output, None
    shape = (1, key.shape[1], key.shape[-1], value.shape[-1])
    dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
    final_states = [
        state if state is not None else torch.zeros(shape, dtype=dtype, device=key.device) for state in states
    ]
    return output, torch.cat(final_states)


def _poisoned_positions(bad: torch.Tensor, offsets: list[int] | None) -> torch.Tensor:
    """(B, H, T) bool: the positions at or after a non-finite input of their row (of their sequence, for packed
    sequences at `offsets`)."""
    seen = bad.cumsum(-1)
    if offsets is not None:  # restart the count at every packed sequence
        lengths = torch.tensor([end - start for start, end in zip(offsets[:-1], offsets[1:])], device=bad.device)
        before = torch.nn.functional.pad(seen, (1, 0))[..., offsets[:-1]]  # the count before each sequence starts
        seen = seen - before.repeat_interleave(lengths, dim=-1)
    return seen > 0


def _own_state(result: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The final state that autograd records as a tensor of its own, not a view of a kernel's (B·H, d_k, d_v)
    result: a layer that returns it (a cache's new state) under FSDP2 would otherwise warn that an in-place operation
    on the view drops FSDP's pre-backward hook. One copy of the state per forward, only with gradients."""
    output, state = result
    if state is not None and state.requires_grad and state._base is not None:
        state = state.clone()
    return output, state


def _causal_despite_non_finite(run, query, key, value, beta, initial_state, offsets):
    """`run(query, key, value, beta, initial_state)`, keeping a non-finite input where it is: a chunkwise product
    multiplies the rows of a chunk together, and 0 · NaN = NaN would carry a NaN at position t into the outputs
    before t. When the output is not all finite (one reduction, on CPU tensors: `sums_are_finite`), the rule runs
    again with the non-finite positions' inputs zeroed — what comes before them does not depend on them — and every
    output from such a position on (and the final state of its row or sequence) is NaN. Other devices' tensors (a GPU:
    a read-back at every layer would stall its queue) are checked only inside `memlm.kernels.checking_every_call`;
    memlm's models collect the sums and read them once per forward (`keeps_non_finite_in_place`)."""
    output, state = run(query, key, value, beta, initial_state)
    if key.shape[2] == 1 or sums_are_finite(output):
        return output, state
    bad = ~(torch.isfinite(query).all(-1) & torch.isfinite(key).all(-1) & torch.isfinite(value).all(-1))
    if beta is not None:
        bad |= ~torch.isfinite(beta)
    if not bool(bad.any()):  # a finite input whose output overflowed: nothing to keep in place
        return output, state
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    query, key, value = (torch.where(bad[..., None], zero, tensor) for tensor in (query, key, value))
    beta = None if beta is None else torch.where(bad, zero.to(beta.dtype), beta)
    output, state = run(query, key, value, beta, initial_state)
    poisoned = _poisoned_positions(bad, offsets)
    output = torch.where(poisoned[..., None], torch.full((), float("nan"), dtype=output.dtype), output)
    if state is not None:
        if offsets is None:
            spoiled = poisoned[..., -1]  # (B, H)
        else:  # (S, H): a sequence's last position
            spoiled = poisoned[0, :, [end - 1 for end in offsets[1:]]].transpose(0, 1)
        state = torch.where(spoiled[..., None, None], torch.full((), float("nan"), dtype=state.dtype), state)
    return output, state


def delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    backend: str | None = None,
    hub_kernel=None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the delta rule over a sequence (SPEC §1).

    Args:
        query: ``(B, H, T, d_k)``, already feature-mapped, normalised and scaled by the caller.
        key: ``(B, H, T, d_k)``.
        value: ``(B, H, T, d_v)``.
        beta: write strengths ``(B, H, T)``; ``None`` means β = 1.
        initial_state: memory entering the sequence, ``(B, H, d_k, d_v)`` (float32); ``None`` means zeros.
        output_final_state: also return the memory after the last token.
        chunk_size: tokens per chunk of the chunkwise implementation (any T works; the last chunk is padded). It
            does not change the result; FLA's kernels take 16, 32 or 64 and run other values with 64.
        cu_seqlens: variable-length sequences packed back to back in one row (batch size 1): the N + 1 offsets of
            their starts and end. Each sequence starts from its own initial state ``(N, H, d_k, d_v)`` (or zeros)
            and the final states are ``(N, H, d_k, d_v)``; no padding is computed.
        cu_seqlens_cpu: the same offsets on the host (a list or a CPU tensor), when the caller has them: then no
            kernel reads them back from the device (no GPU→CPU synchronisation). Without it they are read once.
        backend: ``"torch"``, ``"triton"``, ``"fla"`` or ``"reference"``; ``None`` reads ``$MEMLM_KERNELS``, else
            picks, for CUDA tensors, ``"fla"`` when flash-linear-attention ≥ 0.6 is installed or ``"triton"`` when
            Triton is, and ``"torch"`` otherwise. With ``"triton"`` a single token without gradients runs the fused
            recurrent step, anything else the chunkwise kernel. With ``"fla"`` a single token (without
            ``cu_seqlens``) runs FLA's ``fused_recurrent_delta_rule`` and anything else its ``chunk_delta_rule``;
            what those do not take runs as with ``"triton"``: query, key and value of different dtypes, float32
            beyond one token (FLA's chunk kernel refuses float32) and key widths above 256. float64 runs the torch
            implementation on either.
        hub_kernel: a ``chunk_gated_delta_rule`` kernel that ``kernels.kernelize`` swapped in (see
            :mod:`memlm.kernels.delta_rule.hub_function`; DeltaNet's layers pass theirs). It runs first, with the gate
            g = 0, whatever it covers (float16 or bfloat16, key widths up to 256, more than one token or packed
            sequences); the rest runs on ``backend``.
        in_place: the caller's ``initial_state`` may be overwritten: a one-token step without gradients on the
            ``"torch"`` or ``"triton"`` backend writes the new state into it when it is contiguous and in the
            state's dtype, and returns it as the final state (a decoding cache keeps its memory without a copy);
            anything else returns a new final state as without it.

    Returns:
        The output ``(B, H, T, d_v)`` in the value's dtype, and the final state ``(B, H, d_k, d_v)`` in
        float32 (float64 for float64 inputs) if ``output_final_state``, else ``None``. On CPU tensors a non-finite
        input at position t leaves the outputs before t as they are without it, and the outputs from t on are NaN.

    Example:
        >>> import torch
        >>> from memlm.kernels.delta_rule import delta_rule
        >>> query, value = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
        >>> key = torch.nn.functional.normalize(torch.randn(1, 2, 10, 4), dim=-1)
        >>> output, state = delta_rule(query, key, value, torch.rand(1, 2, 10), output_final_state=True, chunk_size=4)
        >>> output.shape, state.shape, state.dtype
        (torch.Size([1, 2, 10, 4]), torch.Size([1, 2, 4, 4]), torch.float32)
        >>> with_beta_one, _ = delta_rule(query, key, value)  # β = 1: each key's value is replaced outright
        >>> torch.allclose(with_beta_one, delta_rule(query, key, value, backend="reference")[0], atol=1e-5)
        True
    """
    offsets = _check_inputs(query, key, value, beta, initial_state, chunk_size, cu_seqlens, cu_seqlens_cpu)
    backend = resolve_backend(backend, key.device, operation="delta_rule")

    def run(query, key, value, beta, initial_state):
        return _delta_rule(query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens,
                           offsets, backend, hub_kernel, in_place)  # fmt: skip

    return _own_state(_causal_despite_non_finite(run, query, key, value, beta, initial_state, offsets))


def _updatable(initial_state: torch.Tensor | None, *inputs: torch.Tensor | None) -> bool:
    """Whether a one-token step may write its new state into `initial_state` (see `delta_rule`'s `in_place`)."""
    if initial_state is None or not initial_state.is_contiguous() or _needs_gradient(initial_state, *inputs):
        return False
    wide = any(tensor is not None and tensor.dtype == torch.float64 for tensor in (initial_state, *inputs))
    return initial_state.dtype == (torch.float64 if wide else torch.float32)  # the state's compute dtype


def _delta_rule(query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens, offsets, backend,
                hub_kernel, in_place=False):  # fmt: skip
    if torch.is_autocast_enabled(key.device.type):  # the kernels pick their own precision (state in float32)
        with torch.autocast(key.device.type, enabled=False):
            return _delta_rule(query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens,
                               offsets, backend, hub_kernel, in_place)  # fmt: skip
    if hub_kernel is not None:
        from .hub_function import delta_rule_hub, hub_covers

        if hub_covers(query, key, value, cu_seqlens):
            return delta_rule_hub(hub_kernel, query, key, value, beta, initial_state, output_final_state, cu_seqlens,
                                  offsets)  # fmt: skip
    if backend == "fla" and key.dtype != torch.float64:
        check_triton_device(key.device, backend)
        from .flash_linear_attention import delta_rule_fla, fla_covers

        if fla_covers(query, key, value, cu_seqlens):
            return delta_rule_fla(query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens,
                                  offsets)  # fmt: skip
        backend = "triton"  # what FLA's kernels do not take runs memlm's
    if backend == "triton" and key.dtype != torch.float64:
        check_triton_device(key.device)
        if cu_seqlens is not None:
            from .triton_chunk import delta_rule_chunk_triton

            return delta_rule_chunk_triton(query, key, value, beta, initial_state, output_final_state, chunk_size,
                                           cu_seqlens, cu_seqlens_cpu=offsets)  # fmt: skip
        if key.shape[2] == 1 and not _needs_gradient(query, key, value, beta, initial_state):
            from .triton_recurrent import delta_rule_step_triton

            in_place = in_place and _updatable(initial_state, query, key, value, beta)
            return delta_rule_step_triton(query, key, value, beta, initial_state, output_final_state,
                                          in_place=in_place)  # fmt: skip
        from .triton_chunk import delta_rule_chunk_triton

        return delta_rule_chunk_triton(query, key, value, beta, initial_state, output_final_state, chunk_size)
    if cu_seqlens is not None:  # one sequence at a time: the same result, without a packed kernel
        return _per_sequence(offsets, output_final_state, query, key, value, beta, initial_state,
                             run=lambda *inputs: delta_rule(*inputs[:4], initial_state=inputs[4], chunk_size=chunk_size,
                                                            output_final_state=output_final_state, backend=backend))  # fmt: skip
    if backend == "reference":
        return delta_rule_reference(query, key, value, beta, initial_state, output_final_state)
    if key.shape[2] == 1:
        return delta_rule_step(query, key, value, beta, initial_state, output_final_state, in_place)
    return delta_rule_chunk(query, key, value, beta, initial_state, output_final_state, chunk_size)


def sum_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    backend: str | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the sum rule (un-normalised causal linear attention) over a sequence (SPEC §1).

    Same arguments and returns as :func:`delta_rule`, without ``beta`` and ``hub_kernel``. The Triton backend covers
    the one-token step without gradients (the fused recurrent kernel); longer inputs run the torch chunkwise
    implementation, and packed sequences (``cu_seqlens``) run one at a time. ``"fla"`` runs the same as ``"triton"``
    (flash-linear-attention has no sum rule kernel).
    """
    offsets = _check_inputs(query, key, value, None, initial_state, chunk_size, cu_seqlens, cu_seqlens_cpu)
    backend = resolve_backend(backend, key.device, operation="sum_rule")  # "fla" has no sum rule: it runs "triton"

    def run(query, key, value, beta, initial_state):
        return _sum_rule(query, key, value, initial_state, output_final_state, chunk_size, cu_seqlens, offsets,
                         backend, in_place)  # fmt: skip

    return _own_state(_causal_despite_non_finite(run, query, key, value, None, initial_state, offsets))


def _sum_rule(query, key, value, initial_state, output_final_state, chunk_size, cu_seqlens, offsets, backend,
              in_place=False):  # fmt: skip
    if torch.is_autocast_enabled(key.device.type):  # the kernels pick their own precision (state in float32)
        with torch.autocast(key.device.type, enabled=False):
            return _sum_rule(query, key, value, initial_state, output_final_state, chunk_size, cu_seqlens, offsets,
                             backend, in_place)  # fmt: skip
    if cu_seqlens is not None:
        return _per_sequence(offsets, output_final_state, query, key, value, None, initial_state,
                             run=lambda *inputs: sum_rule(*inputs[:3], initial_state=inputs[4], chunk_size=chunk_size,
                                                          output_final_state=output_final_state, backend=backend))  # fmt: skip
    if backend == "reference":
        return sum_rule_reference(query, key, value, initial_state, output_final_state)
    if backend == "triton" and key.shape[2] == 1 and not _needs_gradient(query, key, value, initial_state):
        check_triton_device(key.device)
        from .triton_recurrent import sum_rule_step_triton

        in_place = in_place and _updatable(initial_state, query, key, value)
        return sum_rule_step_triton(query, key, value, initial_state, output_final_state, in_place=in_place)
    if key.shape[2] == 1:
        return sum_rule_step(query, key, value, initial_state, output_final_state, in_place)
    return sum_rule_chunk(query, key, value, initial_state, output_final_state, chunk_size)
