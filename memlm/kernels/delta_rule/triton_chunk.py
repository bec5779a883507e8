"""Chunkwise delta rule in Triton (SPEC §1, §5): forward and a backward that recomputes per chunk.

The same math as ``chunk.py`` (the WY/UT form of Yang et al. 2024, *Parallelizing Linear Transformers with
the Delta Rule over Sequence Length*), one Triton program per chunk or per sequence. Inside a chunk with
entering state ``S ∈ R^{d_k×d_v}`` and rows ``Q, K, V, β`` (SPEC §1)::

    A  = strictly_lower(diag(β) K Kᵀ)                  (1)
    W  = (I + A)⁻¹ diag(β) K;   U = (I + A)⁻¹ diag(β) V    (2)
    V' = U − W S                                       (3)  the chunk's new values, v_t − v̄_t weighted by β
    O  = Q S + causal(Q Kᵀ) V'                          (4)  causal keeps j ≤ i
    S_next = S + Kᵀ V'                                 (5)

Forward, three kernels: ``_prepare_chunk_kernel`` solves the unit-triangular system (1)-(2) for every
chunk in parallel and forms ``causal(Q Kᵀ)``. It works on blocks of ``SOLVE_BLOCK`` = 16 tokens, as
flash-linear-attention's ``solve_tril``: each 16 × 16 diagonal block of ``I + A`` is inverted by forward
substitution (no matrix products), the blocks below the diagonal of ``(I + A)⁻¹`` follow by block forward
substitution (16 products of 16 × 16 blocks for a chunk of 64, see ``_unit_lower_inverse``), and ``A``, ``W`` and
``U`` are formed block by block, so that nothing above the block diagonal is multiplied;
``_state_forward_kernel`` runs the recurrence (3), (5) over the chunks of each sequence and keeps only the
chunk-entry states; ``_output_kernel`` computes (4) for every chunk in parallel.

Backward, two kernels. With ``P = causal(Q Kᵀ)`` and the upstream gradients ``dO`` and ``dS_next``:

    dV' = Pᵀ dO + K dS_next;          dS = dS_next + Qᵀ dO − Wᵀ dV'       (6)  reverse recurrence
    dP  = causal(dO V'ᵀ);             dQ = dO Sᵀ + dP K                     (7)
    d(βV) = (I + A)⁻ᵀ dV';            dA = −strictly_lower(d(βV) V'ᵀ)      (8)
    d(βK) = dA K − d(βV) Sᵀ;          dK = V' dS_nextᵀ + dPᵀ Q + (diag(β) dA)ᵀ K + diag(β) d(βK)    (9)
    dV = diag(β) d(βV);               dβ = rowsum(d(βK) ⊙ K) + rowsum(d(βV) ⊙ V)   (10)

``_state_backward_kernel`` runs (6) in reverse over the chunks of each sequence; ``_chunk_backward_kernel``
computes (7)-(10) for every chunk in parallel. Between forward and backward only per-token quantities
(``W``, ``V'``, the rows of ``(I + A)⁻¹`` and of ``P``) and the chunk-entry states are kept: memory
O(T·(d_k + d_v + C)) + O(T/C·d_k·d_v), never one state per token (the paper's App. E).

Precision. Every product is a ``tl.dot`` with float32 accumulation (float64 for float64 inputs). Its operands
are bfloat16 / float16 when query, key and value all are (tensor cores), and the per-token intermediates
(``W``, ``U``, ``V'``, ``(I + A)⁻¹``, ``P``, ``dV'``) and the chunk-entry states of a state held in registers are
stored in that dtype too; the running state, the final state and the gradients' accumulators stay float32.
Float32 inputs use TF32 products (``FLOAT32_PRECISION``; set it to ``"ieee"`` for exact float32 products on
CUDA cores). The inverse keeps float32 blocks: the forward substitution inside the diagonal blocks is exact
float32 arithmetic, and the products that merge the blocks use TF32 on tensor cores (``INVERSE_PRECISION``;
``"tf32x3"`` gives near-float32 products at three times the cost, ``"ieee"`` exact float32 ones, which it is whenever
``FLOAT32_PRECISION`` is ``"ieee"``). Float64 inputs use exact float64 products.

Tiles. The kernels use chunks of at most ``MAX_CHUNK_SIZE`` tokens whatever ``chunk_size`` asks (the result
does not depend on the chunking), slices of d_k and d_v at most ``BLOCK_WIDTH`` wide (``OUTPUT_BLOCK_WIDTH`` for
the values of the output kernel, ``STATE_TILE`` elements for the forward recurrence's state tile), and the
recurrence keeps its state in registers up to d_k = ``MAX_REGISTER_KEY_DIM`` (half that for float32) and in global
memory, slice by slice, above: every width and chunk size fits the shared memory of sm_80 and sm_90. Warps and
pipeline stages come from ``LAUNCH_OPTIONS``, per GPU target (``gpu_target``) and operand size. A tile's first row is
addressed with a 64-bit scalar (token index × width can pass 2³¹), the rows and columns within it with 32-bit
offsets; (chunk or sequence) × head runs along the first grid axis, which has no 65 535 limit.

With ``cu_seqlens`` the batch holds several sequences back to back; chunks never straddle a sequence boundary
and each sequence has its own initial and final state. Pass the offsets also on the host (``cu_seqlens_cpu``)
to build the chunk tables without a device-to-host copy. Under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors (slowly, and with every product in numpy at the operands' dtype), which is how the CPU test suite
checks them.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(
        "The Triton backend of memlm needs Triton: pip install triton (Linux), or choose the 'torch' backend."
    ) from error

from .chunk import _compute_dtype

__all__ = ["delta_rule_chunk_triton"]

# Tile sizes and launch options, chosen from the register, spill and shared-memory counts of the kernels compiled
# for sm_80 and sm_90 (d = 64 and 128; float32, bfloat16 and float16), not from timings.
#
# The longest chunk the kernels use; a larger chunk_size runs in chunks of this many tokens.
MAX_CHUNK_SIZE = 64
# The widest slice of d_k or d_v that a program holds at once (of 2-byte operands; half as wide for 4- and 8-byte
# ones in the chunk-parallel kernels); wider heads are looped over.
BLOCK_WIDTH = 64
# Up to this d_k (padded to a power of two; half of it for 4- and 8-byte operands) the recurrence kernels hold all
# of d_k × BLOCK_V of the state in registers; wider keys keep the running state in the chunk-state buffer in global
# memory, one slice of rows at a time.
MAX_REGISTER_KEY_DIM = 128
# Elements of the state tile the forward recurrence holds in registers (for 2-byte operands; half for 4-byte ones):
# 128 × 64 at d_k = 128, so that each program reads W and K for half of d_v (FLA's tiling) rather than a quarter.
STATE_TILE = 128 * 64
# Columns of d_v the output kernel (4) covers at once (2-byte operands; half for 4-byte ones): up to d_v = 128 the
# queries and P = causal(Q Kᵀ) of a chunk are read once, not once per slice of d_v.
OUTPUT_BLOCK_WIDTH = 128
# tl.dot needs every dimension to be at least 16.
MIN_BLOCK = 16
# Tokens per block of a chunk in the prepare kernel: (I + A)⁻¹ is solved by forward substitution within these
# diagonal blocks and merged from products of blocks of this size (``_unit_lower_inverse``). A divisor of every
# chunk tile (a power of two, at least MIN_BLOCK).
SOLVE_BLOCK = 16
# Products of float32 operands: "tf32" (tensor cores) or "ieee" (exact, CUDA cores).
FLOAT32_PRECISION = "tf32"
# Products that merge the 16 × 16 blocks of the inverse, on float32 blocks (the diagonal blocks themselves are exact
# float32 forward substitution): "tf32" (tensor cores), "tf32x3" (three TF32 products, near float32 accuracy) or
# "ieee" (exact, CUDA cores). Float32 inputs with FLOAT32_PRECISION = "ieee" and float64 inputs always use "ieee".
# With TF32 the inverse is off by up to 1e-4 (random keys) and 1e-3 (nearly parallel keys, β = 1) (relative, chunks of
# 64, TF32 rounding emulated in PyTorch), the size of one TF32 or float16 rounding and below bfloat16's.
INVERSE_PRECISION = "tf32"
# (num_warps, num_stages) per GPU target, operand size in bytes (2: bfloat16 / float16; 4: float32 and float64,
# whose tiles take twice the shared memory and registers) and kernel; "output_wide" is the output kernel with a
# value slice wider than 64 columns (a 64 × 128 accumulator). "sm_90" is used on compute capability 9.x, "sm_80"
# on every other GPU (and in Triton's interpreter). Chosen from the compiled kernels, not from timings
# (tests/kernels/test_gpu_compile.py checks every entry: no spills, shared memory within the target's limit, for
# d = 64 and 128 and the widest allowed d_k): the sm_90 entries pipeline the loads of the chunk-parallel kernels
# one stage deeper where its 227 KB of shared memory (163 KB on sm_80) leave room.
# The prepare kernel runs its loops unpipelined (one stage): its 16 × 16 blocks of (I + A)⁻¹ and of K Kᵀ take the
# registers that buffered loads would need (two stages spill on sm_80 and sm_90).
LAUNCH_OPTIONS = {
    "sm_80": {
        2: {"prepare": (8, 1), "state": (8, 2), "output": (4, 2), "output_wide": (8, 2), "chunk_backward": (8, 2)},
        4: {"prepare": (8, 1), "state": (8, 1), "output": (4, 2), "output_wide": (8, 2), "chunk_backward": (8, 2)},
    },
    "sm_90": {
        2: {"prepare": (8, 1), "state": (8, 2), "output": (4, 3), "output_wide": (8, 3), "chunk_backward": (8, 3)},
        4: {"prepare": (8, 1), "state": (8, 1), "output": (4, 3), "output_wide": (8, 3), "chunk_backward": (8, 3)},
    },
}


def gpu_target(device: torch.device) -> str:
    """The column of ``LAUNCH_OPTIONS`` for ``device``: "sm_90" on compute capability 9.x, else "sm_80"."""
    if device.type != "cuda":
        return "sm_80"  # Triton's interpreter: one configuration
    return "sm_90" if torch.cuda.get_device_capability(device)[0] == 9 else "sm_80"


_TRITON_DTYPES = {
    torch.float64: tl.float64,
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


# Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns and rounds float32 to bfloat16 toward
# zero. Under it, bfloat16 products run as float32 products of the bfloat16-rounded operands (what the tensor cores
# compute: exact products, float32 sums) and roundings go to nearest even, as on the GPU.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _cast(tile, DTYPE: tl.constexpr):
    """``tile.to(DTYPE)``, rounding to nearest even also under the interpreter."""
    if _INTERPRETED:
        if DTYPE == tl.bfloat16:
            if tile.dtype == tl.float32:
                bits = tile.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                tile = bits.to(tl.float32, bitcast=True)
    return tile.to(DTYPE)


@triton.jit
def _dot(left, right, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    """``left @ right`` on operands cast to ``OPERAND``, accumulated in float32 (float64 for float64 operands)."""
    if _INTERPRETED:
        if OPERAND == tl.bfloat16:
            left, right = _cast(left, OPERAND).to(tl.float32), _cast(right, OPERAND).to(tl.float32)
            return tl.dot(left, right, input_precision="ieee")
    return tl.dot(_cast(left, OPERAND), _cast(right, OPERAND), input_precision=PRECISION)


@triton.jit
def _load_tile(pointer, rows, row_mask, columns, width, DTYPE: tl.constexpr):
    """The tile ``rows × columns`` of a row-major matrix with ``width`` columns, zero outside it, in ``DTYPE``.

    ``pointer`` already points at the tile's first row (a 64-bit scalar offset); ``rows`` and ``columns`` are small
    32-bit offsets within it, so the tile of addresses costs no 64-bit arithmetic per element.
    """
    mask = row_mask[:, None] & (columns[None, :] < width)
    return tl.load(pointer + rows[:, None] * width + columns[None, :], mask=mask, other=0).to(DTYPE)


@triton.jit
def _store_tile(pointer, rows, row_mask, columns, width, tile):
    """Store ``tile`` into the rows ``rows`` and columns ``columns`` of a row-major matrix with ``width`` columns."""
    mask = row_mask[:, None] & (columns[None, :] < width)
    tl.store(pointer + rows[:, None] * width + columns[None, :], _cast(tile, pointer.dtype.element_ty), mask=mask)


@triton.jit
def _locate_chunk(
    chunk, cu_seqlens, chunk_indices, length, num_chunks, CHUNK_SIZE: tl.constexpr, IS_VARLEN: tl.constexpr
):
    """Batch index, first token and end token (exclusive) of ``chunk`` (the chunks of all sequences, in order)."""
    if IS_VARLEN:
        sequence = tl.load(chunk_indices + 2 * chunk)
        index = tl.load(chunk_indices + 2 * chunk + 1)
        batch = 0
        sequence_start = tl.load(cu_seqlens + sequence)
        sequence_end = tl.load(cu_seqlens + sequence + 1)
    else:
        sequence = chunk // num_chunks
        index = chunk % num_chunks
        batch = sequence
        sequence_start = 0
        sequence_end = length
    start = sequence_start + index * CHUNK_SIZE
    return batch, start, tl.minimum(start + CHUNK_SIZE, sequence_end)


@triton.jit
def _locate_sequence(
    sequence, cu_seqlens, chunk_offsets, length, num_chunks, CHUNK_SIZE: tl.constexpr, IS_VARLEN: tl.constexpr
):
    """Batch index, first token, end token (exclusive), first chunk and number of chunks of ``sequence``."""
    if IS_VARLEN:
        batch = 0
        start = tl.load(cu_seqlens + sequence)
        end = tl.load(cu_seqlens + sequence + 1)
        first_chunk = tl.load(chunk_offsets + sequence)
        count = tl.cdiv(end - start, CHUNK_SIZE)
    else:
        batch = sequence
        start = 0
        end = length
        first_chunk = sequence * num_chunks
        count = num_chunks
    return batch, start, end, first_chunk, count


@triton.jit
def _load_blocks(
    pointer, first_row, rows, valid_blocks, columns, width, BLOCK_ROWS: tl.constexpr, DTYPE: tl.constexpr
):
    """The tiles ``rows × columns`` of the chunk's blocks of ``BLOCK_ROWS`` tokens (a tuple, block 0 first)."""
    tiles = ()
    for block in tl.static_range(len(valid_blocks)):
        block_pointer = pointer + (first_row + block * BLOCK_ROWS) * width
        tiles = tiles + (_load_tile(block_pointer, rows, valid_blocks[block], columns, width, DTYPE),)
    return tiles


@triton.jit
def _store_lower_blocks(pointer, first_row, rows, valid_blocks, lower_blocks, BLOCK_T: tl.constexpr):
    """Store a chunk's ``BLOCK_T × BLOCK_T`` lower block-triangular matrix, given its blocks on and below the
    diagonal (``lower_blocks``: block (i, j), j ≤ i, at ``i(i+1)/2 + j``), as rows of ``BLOCK_T`` columns with zero
    blocks above the diagonal."""
    BLOCK_ROWS: tl.constexpr = BLOCK_T // len(valid_blocks)
    for row_block in tl.static_range(len(valid_blocks)):
        block_pointer = pointer + (first_row + row_block * BLOCK_ROWS) * BLOCK_T
        for column_block in tl.static_range(len(valid_blocks)):
            if column_block <= row_block:
                tile = lower_blocks[row_block * (row_block + 1) // 2 + column_block]
            else:
                tile = tl.zeros((BLOCK_ROWS, BLOCK_ROWS), dtype=lower_blocks[0].dtype)
            _store_tile(block_pointer + column_block * BLOCK_ROWS, rows, valid_blocks[row_block], rows, BLOCK_T, tile)


@triton.jit
def _store_lower_blocks_times(
    pointer, first_row, rows, valid_blocks, lower_blocks, tiles, columns, width, OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Store the product of a lower block-triangular matrix (``lower_blocks``, as in ``_store_lower_blocks``) and
    the chunk's ``tiles`` (one per block of rows), block row by block row: the zero blocks are not multiplied."""
    BLOCK_ROWS: tl.constexpr = tiles[0].shape[0]
    for row_block in tl.static_range(len(valid_blocks)):
        # Block (row_block, column_block) is lower_blocks[row_block(row_block + 1)/2 + column_block]; the index is
        # written out, as a name assigned a compile-time value becomes a run-time one.
        product = _dot(lower_blocks[row_block * (row_block + 1) // 2], tiles[0], OPERAND, PRECISION)
        for column_block in tl.static_range(1, row_block + 1):
            product += _dot(
                lower_blocks[row_block * (row_block + 1) // 2 + column_block], tiles[column_block], OPERAND, PRECISION
            )
        block_pointer = pointer + (first_row + row_block * BLOCK_ROWS) * width
        _store_tile(block_pointer, rows, valid_blocks[row_block], columns, width, product)


@triton.jit
def _unit_lower_inverse(gram, beta_blocks, rows, PRECISION: tl.constexpr):
    """The blocks on and below the diagonal of ``(I + A)⁻¹``, ``A = strictly_lower(diag(β) K Kᵀ)`` (Eq. 1).

    ``gram`` holds the blocks ``K_i K_jᵀ`` (j ≤ i, at ``i(i+1)/2 + j``) of the chunk's blocks of b rows, ``beta_blocks``
    their β; the result is laid out the same way. Two steps, as flash-linear-attention's ``solve_tril``:

    1. Each diagonal block ``L_ii = I + A_ii`` is inverted by forward substitution, row by row and without matrix
       products: row r of ``X = L_ii⁻¹`` is ``e_r − Σ_{k<r} A_ii[r, k] X[k, :]``, exact in the tile's dtype. The
       coefficients ``A_ii[r, :]`` are read as a column of ``A_iiᵀ = strictly_upper(K_i K_iᵀ diag(β_i))`` (the Gram
       block is symmetric), so that they lie along the rows of ``X`` without a transposition.
    2. The blocks below the diagonal follow by block forward substitution, ``N_ij = −L_ii⁻¹ Σ_{j≤k<i} A_ik N_kj``
       (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, §14.2): for four blocks, 16 products of
       b × b blocks at ``PRECISION``, on the tile's dtype (float32 or float64).
    """
    BLOCK_ROWS: tl.constexpr = rows.shape[0]
    NUM_BLOCKS: tl.constexpr = len(beta_blocks)
    inverse = ()
    for row_block in tl.static_range(NUM_BLOCKS):
        beta_rows = beta_blocks[row_block]
        # 1. X = L_ii⁻¹, rows 1 .. b − 1 in order (row 0 is e_0), from A_iiᵀ.
        gram_block = gram[row_block * (row_block + 1) // 2 + row_block]
        system_transposed = tl.where(rows[:, None] < rows[None, :], gram_block * beta_rows[None, :], 0)
        diagonal = (rows[:, None] == rows[None, :]).to(gram_block.dtype)
        for step in range(1, BLOCK_ROWS):
            coefficients = tl.sum(tl.where(rows[None, :] == step, system_transposed, 0), 1)  # A_ii[step, :]
            row = tl.sum(coefficients[:, None] * diagonal, 0)
            diagonal -= tl.where(rows[:, None] == step, row[None, :], 0)
        # 2. N_ij for j < i, from the blocks N_kj of the rows above; A_ik = diag(β_i) K_i K_kᵀ is gram[i(i+1)/2 + k]
        # scaled.
        for column_block in tl.static_range(row_block):
            joined = tl.dot(
                beta_rows[:, None] * gram[row_block * (row_block + 1) // 2 + column_block],
                inverse[column_block * (column_block + 1) // 2 + column_block],
                input_precision=PRECISION,
            )
            for middle in tl.static_range(column_block + 1, row_block):
                joined += tl.dot(
                    beta_rows[:, None] * gram[row_block * (row_block + 1) // 2 + middle],
                    inverse[middle * (middle + 1) // 2 + column_block],
                    input_precision=PRECISION,
                )
            inverse = inverse + (-tl.dot(diagonal, joined, input_precision=PRECISION),)
        inverse = inverse + (diagonal,)
    return inverse


@triton.jit
def _prepare_chunk_kernel(
    query,
    key,
    value,
    beta,
    inverse,
    scores,
    weights,
    updates,
    cu_seqlens,
    chunk_indices,
    length,
    num_heads,
    num_chunks,
    key_dim,
    value_dim,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SOLVE_BLOCK: tl.constexpr,
    HAS_BETA: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DTYPE: tl.constexpr,
    OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
    INVERSE_PRECISION: tl.constexpr,
):
    """Per (chunk, head): the rows of ``(I + A)⁻¹``, ``W``, ``U`` (Eqs. 1-2) and ``P = causal(Q Kᵀ)``.

    ``A``, ``(I + A)⁻¹``, ``W`` and ``U`` are formed from products of blocks of ``SOLVE_BLOCK`` tokens, none above the
    block diagonal of the lower triangular ``A`` and ``(I + A)⁻¹``; ``P`` from whole tiles.
    """
    chunk_head = tl.program_id(0)
    chunk, head = chunk_head // num_heads, chunk_head % num_heads
    batch, start, end = _locate_chunk(chunk, cu_seqlens, chunk_indices, length, num_chunks, CHUNK_SIZE, IS_VARLEN)
    BLOCK_ROWS: tl.constexpr = SOLVE_BLOCK
    NUM_BLOCKS: tl.constexpr = BLOCK_T // BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)
    first_row = (batch * num_heads + head).to(tl.int64) * length + start  # 64-bit, scalar
    valid_blocks = ()
    beta_blocks = ()
    for block in tl.static_range(NUM_BLOCKS):
        valid = start + block * BLOCK_ROWS + rows < end
        if HAS_BETA:
            beta_rows = tl.load(beta + first_row + block * BLOCK_ROWS + rows, mask=valid, other=0).to(DTYPE)
        else:
            beta_rows = valid.to(DTYPE)
        valid_blocks = valid_blocks + (valid,)
        beta_blocks = beta_blocks + (beta_rows,)

    # P = causal(Q Kᵀ) for Eqs. (4) and (6), on whole tiles: as blocks, its 10 accumulators beside the Gram
    # blocks' would spill registers.
    offsets = tl.arange(0, BLOCK_T)
    valid = start + offsets < end
    query_key = tl.zeros((BLOCK_T, BLOCK_T), dtype=DTYPE)
    for column_start in range(0, key_dim, BLOCK_K):
        columns = column_start + tl.arange(0, BLOCK_K)
        keys = _load_tile(key + first_row * key_dim, offsets, valid, columns, key_dim, OPERAND)
        queries = _load_tile(query + first_row * key_dim, offsets, valid, columns, key_dim, OPERAND)
        query_key += _dot(queries, tl.trans(keys), OPERAND, PRECISION)
    causal = offsets[:, None] >= offsets[None, :]
    _store_tile(scores + first_row * BLOCK_T, offsets, valid, offsets, BLOCK_T, tl.where(causal, query_key, 0))

    # (1) The blocks K_i K_jᵀ of A = strictly_lower(diag(β) K Kᵀ), j ≤ i, at i(i+1)/2 + j.
    gram = ()
    for _ in tl.static_range(NUM_BLOCKS * (NUM_BLOCKS + 1) // 2):
        gram = gram + (tl.zeros((BLOCK_ROWS, BLOCK_ROWS), dtype=DTYPE),)
    for column_start in range(0, key_dim, BLOCK_K):
        columns = column_start + tl.arange(0, BLOCK_K)
        keys = _load_blocks(key, first_row, rows, valid_blocks, columns, key_dim, BLOCK_ROWS, OPERAND)
        gram_sums = ()
        for row_block in tl.static_range(NUM_BLOCKS):
            for column_block in tl.static_range(row_block + 1):
                # Block (row_block, column_block) at row_block(row_block + 1)/2 + column_block, written out: a name
                # assigned a compile-time value becomes a run-time one, which cannot index a tuple.
                gram_sums = gram_sums + (
                    gram[row_block * (row_block + 1) // 2 + column_block]
                    + _dot(keys[row_block], tl.trans(keys[column_block]), OPERAND, PRECISION),
                )
        gram = gram_sums
    inverse_blocks = _unit_lower_inverse(gram, beta_blocks, rows, INVERSE_PRECISION)
    _store_lower_blocks(inverse, first_row, rows, valid_blocks, inverse_blocks, BLOCK_T)

    # (2) W = (I + A)⁻¹ diag(β) K and U = (I + A)⁻¹ diag(β) V.
    inverse_operands = ()
    for pair in tl.static_range(len(inverse_blocks)):
        inverse_operands = inverse_operands + (_cast(inverse_blocks[pair], OPERAND),)
    for column_start in range(0, key_dim, BLOCK_K):
        columns = column_start + tl.arange(0, BLOCK_K)
        keys = _load_blocks(key, first_row, rows, valid_blocks, columns, key_dim, BLOCK_ROWS, DTYPE)
        weighted_keys = ()
        for block in tl.static_range(NUM_BLOCKS):
            weighted_keys = weighted_keys + (keys[block] * beta_blocks[block][:, None],)
        _store_lower_blocks_times(
            weights, first_row, rows, valid_blocks, inverse_operands, weighted_keys, columns, key_dim, OPERAND,
            PRECISION,
        )  # fmt: skip
    for column_start in range(0, value_dim, BLOCK_V):
        columns = column_start + tl.arange(0, BLOCK_V)
        values = _load_blocks(value, first_row, rows, valid_blocks, columns, value_dim, BLOCK_ROWS, DTYPE)
        weighted_values = ()
        for block in tl.static_range(NUM_BLOCKS):
            weighted_values = weighted_values + (values[block] * beta_blocks[block][:, None],)
        _store_lower_blocks_times(
            updates, first_row, rows, valid_blocks, inverse_operands, weighted_values, columns, value_dim, OPERAND,
            PRECISION,
        )  # fmt: skip


@triton.jit
def _state_forward_kernel(
    key,
    weights,
    updates,
    initial_state,
    states,
    new_values,
    final_state,
    cu_seqlens,
    chunk_offsets,
    length,
    num_heads,
    num_chunks,
    key_dim,
    value_dim,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STATE_IN_REGISTERS: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DTYPE: tl.constexpr,
    OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (sequence, head, slice of d_v): the recurrence (3), (5) over the sequence's chunks, in order.

    Stores the state entering each chunk and the new values ``V'``. With ``STATE_IN_REGISTERS``, ``BLOCK_K``
    covers all of d_k and the state tile stays in registers; otherwise the state entering chunk c is read back
    from ``states`` (float32) ``BLOCK_K`` rows at a time, and the state leaving the last chunk goes to
    ``final_state`` (which must then be given).
    """
    sequence_head, value_block = tl.program_id(0), tl.program_id(1)
    sequence, head = sequence_head // num_heads, sequence_head % num_heads
    batch, sequence_start, sequence_end, first_chunk, count = _locate_sequence(
        sequence, cu_seqlens, chunk_offsets, length, num_chunks, CHUNK_SIZE, IS_VARLEN
    )
    row_start = (batch * num_heads + head).to(tl.int64) * length
    offsets = tl.arange(0, BLOCK_T)
    value_columns = value_block * BLOCK_V + tl.arange(0, BLOCK_V)
    state_size = tl.cast(key_dim, tl.int64) * value_dim  # tl.cast: a width of 1 arrives as a constexpr
    head_state = sequence_head.to(tl.int64) * state_size
    chunk_stride = num_heads * state_size  # from the state of one chunk to the next

    if STATE_IN_REGISTERS:
        key_columns = tl.arange(0, BLOCK_K)
        key_valid = key_columns < key_dim
        if HAS_INITIAL_STATE:
            state = _load_tile(initial_state + head_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
        else:
            state = tl.zeros((BLOCK_K, BLOCK_V), dtype=DTYPE)
        for index in range(0, count):
            start = sequence_start + index * CHUNK_SIZE
            valid = start + offsets < tl.minimum(start + CHUNK_SIZE, sequence_end)
            first_row = row_start + start
            # The state entering the chunk: all the backward keeps of the recurrence.
            chunk_state = states + (first_chunk + index).to(tl.int64) * chunk_stride + head * state_size
            _store_tile(chunk_state, key_columns, key_valid, value_columns, value_dim, state)
            # (3) V' = U − W S.
            chunk_weights = _load_tile(weights + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
            keys = _load_tile(key + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
            chunk_updates = _load_tile(
                updates + first_row * value_dim, offsets, valid, value_columns, value_dim, DTYPE
            )
            chunk_new_values = chunk_updates - _dot(chunk_weights, state, OPERAND, PRECISION)
            chunk_new_values = _cast(chunk_new_values, new_values.dtype.element_ty)
            _store_tile(new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, chunk_new_values)
            # (5) S_next = S + Kᵀ V'.
            state += _dot(tl.trans(keys), chunk_new_values, OPERAND, PRECISION)
        if STORE_FINAL_STATE:
            _store_tile(final_state + head_state, key_columns, key_valid, value_columns, value_dim, state)
    else:
        # The state entering the first chunk (or, for an empty sequence, the final state) is the initial state.
        if count > 0:
            target = states + first_chunk.to(tl.int64) * chunk_stride + head * state_size
        else:
            target = final_state + head_state
        for key_start in range(0, key_dim, BLOCK_K):
            key_columns = key_start + tl.arange(0, BLOCK_K)
            key_valid = key_columns < key_dim
            if HAS_INITIAL_STATE:
                tile = _load_tile(initial_state + head_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
            else:
                tile = tl.zeros((BLOCK_K, BLOCK_V), dtype=DTYPE)
            _store_tile(target, key_columns, key_valid, value_columns, value_dim, tile)
        tl.debug_barrier()  # the stores above are read back by other threads of the program
        for index in range(0, count):
            start = sequence_start + index * CHUNK_SIZE
            valid = start + offsets < tl.minimum(start + CHUNK_SIZE, sequence_end)
            first_row = row_start + start
            chunk_state = states + (first_chunk + index).to(tl.int64) * chunk_stride + head * state_size
            if index + 1 < count:
                next_state = chunk_state + chunk_stride
            else:
                next_state = final_state + head_state
            # (3) V' = U − W S, summed over slices of d_k.
            chunk_new_values = _load_tile(
                updates + first_row * value_dim, offsets, valid, value_columns, value_dim, DTYPE
            )
            for key_start in range(0, key_dim, BLOCK_K):
                key_columns = key_start + tl.arange(0, BLOCK_K)
                key_valid = key_columns < key_dim
                chunk_weights = _load_tile(
                    weights + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND
                )
                state = _load_tile(chunk_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
                chunk_new_values -= _dot(chunk_weights, state, OPERAND, PRECISION)
            chunk_new_values = _cast(chunk_new_values, new_values.dtype.element_ty)
            _store_tile(new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, chunk_new_values)
            # (5) S_next = S + Kᵀ V', slice by slice of d_k.
            for key_start in range(0, key_dim, BLOCK_K):
                key_columns = key_start + tl.arange(0, BLOCK_K)
                key_valid = key_columns < key_dim
                keys = _load_tile(key + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
                state = _load_tile(chunk_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
                state += _dot(tl.trans(keys), chunk_new_values, OPERAND, PRECISION)
                _store_tile(next_state, key_columns, key_valid, value_columns, value_dim, state)
            tl.debug_barrier()


@triton.jit
def _output_kernel(
    query,
    scores,
    new_values,
    states,
    output,
    cu_seqlens,
    chunk_indices,
    length,
    num_heads,
    num_chunks,
    key_dim,
    value_dim,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DTYPE: tl.constexpr,
    OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, head, slice of d_v): the output (4), O = Q S + causal(Q Kᵀ) V'."""
    chunk_head, value_block = tl.program_id(0), tl.program_id(1)
    chunk, head = chunk_head // num_heads, chunk_head % num_heads
    batch, start, end = _locate_chunk(chunk, cu_seqlens, chunk_indices, length, num_chunks, CHUNK_SIZE, IS_VARLEN)
    offsets = tl.arange(0, BLOCK_T)
    valid = start + offsets < end
    first_row = (batch * num_heads + head).to(tl.int64) * length + start  # 64-bit, scalar
    value_columns = value_block * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk_state = states + chunk_head.to(tl.int64) * key_dim * value_dim

    chunk_scores = _load_tile(scores + first_row * BLOCK_T, offsets, valid, offsets, BLOCK_T, OPERAND)
    chunk_new_values = _load_tile(
        new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
    )
    chunk_output = _dot(chunk_scores, chunk_new_values, OPERAND, PRECISION)
    for column_start in range(0, key_dim, BLOCK_K):
        key_columns = column_start + tl.arange(0, BLOCK_K)
        queries = _load_tile(query + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
        state = _load_tile(chunk_state, key_columns, key_columns < key_dim, value_columns, value_dim, OPERAND)
        chunk_output += _dot(queries, state, OPERAND, PRECISION)
    _store_tile(output + first_row * value_dim, offsets, valid, value_columns, value_dim, chunk_output)


@triton.jit
def _state_backward_kernel(
    query,
    key,
    weights,
    scores,
    grad_output,
    grad_final_state,
    grad_states,
    grad_new_values,
    grad_initial_state,
    cu_seqlens,
    chunk_offsets,
    length,
    num_heads,
    num_chunks,
    key_dim,
    value_dim,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STATE_IN_REGISTERS: tl.constexpr,
    HAS_GRAD_FINAL_STATE: tl.constexpr,
    STORE_GRAD_INITIAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DTYPE: tl.constexpr,
    OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (sequence, head, slice of d_v): the reverse recurrence (6) over the sequence's chunks, last first.

    Stores the gradient of the state leaving each chunk and ``dV'``. With ``STATE_IN_REGISTERS``, ``BLOCK_K``
    covers all of d_k; otherwise the running gradient lives in ``grad_states`` (float32) and the gradient of the
    state entering the first chunk goes to ``grad_initial_state`` (which must then be given).
    """
    sequence_head, value_block = tl.program_id(0), tl.program_id(1)
    sequence, head = sequence_head // num_heads, sequence_head % num_heads
    batch, sequence_start, sequence_end, first_chunk, count = _locate_sequence(
        sequence, cu_seqlens, chunk_offsets, length, num_chunks, CHUNK_SIZE, IS_VARLEN
    )
    row_start = (batch * num_heads + head).to(tl.int64) * length
    offsets = tl.arange(0, BLOCK_T)
    value_columns = value_block * BLOCK_V + tl.arange(0, BLOCK_V)
    state_size = tl.cast(key_dim, tl.int64) * value_dim  # tl.cast: a width of 1 arrives as a constexpr
    head_state = sequence_head.to(tl.int64) * state_size
    chunk_stride = num_heads * state_size

    if STATE_IN_REGISTERS:
        key_columns = tl.arange(0, BLOCK_K)
        key_valid = key_columns < key_dim
        if HAS_GRAD_FINAL_STATE:
            grad_state = _load_tile(
                grad_final_state + head_state, key_columns, key_valid, value_columns, value_dim, DTYPE
            )
        else:
            grad_state = tl.zeros((BLOCK_K, BLOCK_V), dtype=DTYPE)
        for step in range(0, count):
            index = count - 1 - step
            start = sequence_start + index * CHUNK_SIZE
            valid = start + offsets < tl.minimum(start + CHUNK_SIZE, sequence_end)
            first_row = row_start + start
            chunk_grad_state = grad_states + (first_chunk + index).to(tl.int64) * chunk_stride + head * state_size
            _store_tile(chunk_grad_state, key_columns, key_valid, value_columns, value_dim, grad_state)

            queries = _load_tile(query + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
            keys = _load_tile(key + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
            chunk_weights = _load_tile(weights + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
            chunk_grad_output = _load_tile(
                grad_output + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
            )
            chunk_scores = _load_tile(scores + first_row * BLOCK_T, offsets, valid, offsets, BLOCK_T, OPERAND)
            # (6) dV' = Pᵀ dO + K dS_next, then dS = dS_next + Qᵀ dO − Wᵀ dV'.
            chunk_grad_new_values = _dot(tl.trans(chunk_scores), chunk_grad_output, OPERAND, PRECISION)
            chunk_grad_new_values += _dot(keys, grad_state, OPERAND, PRECISION)
            chunk_grad_new_values = _cast(chunk_grad_new_values, grad_new_values.dtype.element_ty)
            _store_tile(
                grad_new_values + first_row * value_dim,
                offsets,
                valid,
                value_columns,
                value_dim,
                chunk_grad_new_values,
            )
            grad_state += _dot(tl.trans(queries), chunk_grad_output, OPERAND, PRECISION)
            grad_state -= _dot(tl.trans(chunk_weights), chunk_grad_new_values, OPERAND, PRECISION)
        if STORE_GRAD_INITIAL_STATE:
            _store_tile(grad_initial_state + head_state, key_columns, key_valid, value_columns, value_dim, grad_state)
    else:
        # The gradient of the state leaving the last chunk (for an empty sequence: of the initial state).
        if count > 0:
            target = grad_states + (first_chunk + count - 1).to(tl.int64) * chunk_stride + head * state_size
        else:
            target = grad_initial_state + head_state
        for key_start in range(0, key_dim, BLOCK_K):
            key_columns = key_start + tl.arange(0, BLOCK_K)
            key_valid = key_columns < key_dim
            if HAS_GRAD_FINAL_STATE:
                tile = _load_tile(
                    grad_final_state + head_state, key_columns, key_valid, value_columns, value_dim, DTYPE
                )
            else:
                tile = tl.zeros((BLOCK_K, BLOCK_V), dtype=DTYPE)
            _store_tile(target, key_columns, key_valid, value_columns, value_dim, tile)
        tl.debug_barrier()
        for step in range(0, count):
            index = count - 1 - step
            start = sequence_start + index * CHUNK_SIZE
            valid = start + offsets < tl.minimum(start + CHUNK_SIZE, sequence_end)
            first_row = row_start + start
            chunk_grad_state = grad_states + (first_chunk + index).to(tl.int64) * chunk_stride + head * state_size
            if index > 0:
                previous_grad_state = chunk_grad_state - chunk_stride
            else:
                previous_grad_state = grad_initial_state + head_state
            chunk_grad_output = _load_tile(
                grad_output + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
            )
            chunk_scores = _load_tile(scores + first_row * BLOCK_T, offsets, valid, offsets, BLOCK_T, OPERAND)
            # (6) dV' = Pᵀ dO + K dS_next, summed over slices of d_k.
            chunk_grad_new_values = _dot(tl.trans(chunk_scores), chunk_grad_output, OPERAND, PRECISION)
            for key_start in range(0, key_dim, BLOCK_K):
                key_columns = key_start + tl.arange(0, BLOCK_K)
                key_valid = key_columns < key_dim
                keys = _load_tile(key + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
                grad_state = _load_tile(chunk_grad_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
                chunk_grad_new_values += _dot(keys, grad_state, OPERAND, PRECISION)
            chunk_grad_new_values = _cast(chunk_grad_new_values, grad_new_values.dtype.element_ty)
            _store_tile(
                grad_new_values + first_row * value_dim,
                offsets,
                valid,
                value_columns,
                value_dim,
                chunk_grad_new_values,
            )
            # dS = dS_next + Qᵀ dO − Wᵀ dV', slice by slice of d_k.
            for key_start in range(0, key_dim, BLOCK_K):
                key_columns = key_start + tl.arange(0, BLOCK_K)
                key_valid = key_columns < key_dim
                queries = _load_tile(query + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
                chunk_weights = _load_tile(
                    weights + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND
                )
                grad_state = _load_tile(chunk_grad_state, key_columns, key_valid, value_columns, value_dim, DTYPE)
                grad_state += _dot(tl.trans(queries), chunk_grad_output, OPERAND, PRECISION)
                grad_state -= _dot(tl.trans(chunk_weights), chunk_grad_new_values, OPERAND, PRECISION)
                _store_tile(previous_grad_state, key_columns, key_valid, value_columns, value_dim, grad_state)
            tl.debug_barrier()


@triton.jit
def _chunk_backward_kernel(
    query,
    key,
    value,
    beta,
    inverse,
    new_values,
    states,
    grad_output,
    grad_states,
    grad_new_values,
    grad_query,
    grad_key,
    grad_value,
    grad_beta,
    cu_seqlens,
    chunk_indices,
    length,
    num_heads,
    num_chunks,
    key_dim,
    value_dim,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_BETA: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DTYPE: tl.constexpr,
    OPERAND: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (chunk, head): the chunk-local gradients (7)-(10) of query, key, value and beta."""
    chunk_head = tl.program_id(0)
    chunk, head = chunk_head // num_heads, chunk_head % num_heads
    batch, start, end = _locate_chunk(chunk, cu_seqlens, chunk_indices, length, num_chunks, CHUNK_SIZE, IS_VARLEN)
    offsets = tl.arange(0, BLOCK_T)
    valid = start + offsets < end
    first_row = (batch * num_heads + head).to(tl.int64) * length + start  # 64-bit, scalar
    if HAS_BETA:
        beta_rows = tl.load(beta + first_row + offsets, mask=valid, other=0).to(DTYPE)
    else:
        beta_rows = valid.to(DTYPE)
    inverse_transposed = tl.trans(_load_tile(inverse + first_row * BLOCK_T, offsets, valid, offsets, BLOCK_T, OPERAND))
    state_offset = chunk_head.to(tl.int64) * key_dim * value_dim
    chunk_state, chunk_grad_state = states + state_offset, grad_states + state_offset  # S and dS_next

    # dP = dO V'ᵀ and dA = −d(βV) V'ᵀ, before masking (Eqs. 7-8); dV and the value part of dβ (Eq. 10).
    grad_scores = tl.zeros((BLOCK_T, BLOCK_T), dtype=DTYPE)
    grad_system = tl.zeros((BLOCK_T, BLOCK_T), dtype=DTYPE)
    grad_beta_rows = tl.zeros((BLOCK_T,), dtype=DTYPE)
    for column_start in range(0, value_dim, BLOCK_V):
        value_columns = column_start + tl.arange(0, BLOCK_V)
        chunk_grad_output = _load_tile(
            grad_output + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
        )
        chunk_new_values = _load_tile(
            new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
        )
        chunk_grad_new_values = _load_tile(
            grad_new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
        )
        values = _load_tile(value + first_row * value_dim, offsets, valid, value_columns, value_dim, DTYPE)
        # d(βV) = (I + A)⁻ᵀ dV'
        grad_weighted_values = _dot(inverse_transposed, chunk_grad_new_values, OPERAND, PRECISION)
        grad_scores += _dot(chunk_grad_output, tl.trans(chunk_new_values), OPERAND, PRECISION)
        grad_system -= _dot(grad_weighted_values, tl.trans(chunk_new_values), OPERAND, PRECISION)
        grad_beta_rows += tl.sum(grad_weighted_values * values, 1)
        _store_tile(
            grad_value + first_row * value_dim,
            offsets,
            valid,
            value_columns,
            value_dim,
            grad_weighted_values * beta_rows[:, None],
        )
    grad_scores = _cast(tl.where(offsets[:, None] >= offsets[None, :], grad_scores, 0), OPERAND)
    grad_system = tl.where(offsets[:, None] > offsets[None, :], grad_system, 0)
    grad_system_beta = _cast(grad_system * beta_rows[:, None], OPERAND)
    grad_system = _cast(grad_system, OPERAND)

    for column_start in range(0, key_dim, BLOCK_K):
        key_columns = column_start + tl.arange(0, BLOCK_K)
        key_valid = key_columns < key_dim
        queries = _load_tile(query + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
        keys = _load_tile(key + first_row * key_dim, offsets, valid, key_columns, key_dim, OPERAND)
        # The terms that sum over d_v: dO Sᵀ, V' dS_nextᵀ and dV' Sᵀ (so that d(βV) Sᵀ = (I + A)⁻ᵀ dV' Sᵀ).
        grad_output_state = tl.zeros((BLOCK_T, BLOCK_K), dtype=DTYPE)
        new_values_grad_state = tl.zeros((BLOCK_T, BLOCK_K), dtype=DTYPE)
        grad_new_values_state = tl.zeros((BLOCK_T, BLOCK_K), dtype=DTYPE)
        for value_start in range(0, value_dim, BLOCK_V):
            value_columns = value_start + tl.arange(0, BLOCK_V)
            state = _load_tile(chunk_state, key_columns, key_valid, value_columns, value_dim, OPERAND)
            grad_state = _load_tile(chunk_grad_state, key_columns, key_valid, value_columns, value_dim, OPERAND)
            chunk_grad_output = _load_tile(
                grad_output + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
            )
            chunk_new_values = _load_tile(
                new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
            )
            chunk_grad_new_values = _load_tile(
                grad_new_values + first_row * value_dim, offsets, valid, value_columns, value_dim, OPERAND
            )
            grad_output_state += _dot(chunk_grad_output, tl.trans(state), OPERAND, PRECISION)
            new_values_grad_state += _dot(chunk_new_values, tl.trans(grad_state), OPERAND, PRECISION)
            grad_new_values_state += _dot(chunk_grad_new_values, tl.trans(state), OPERAND, PRECISION)
        # (7) dQ = dO Sᵀ + dP K.
        chunk_grad_query = grad_output_state + _dot(grad_scores, keys, OPERAND, PRECISION)
        _store_tile(grad_query + first_row * key_dim, offsets, valid, key_columns, key_dim, chunk_grad_query)
        # (9) d(βK) = dA K − d(βV) Sᵀ; dK = V' dS_nextᵀ + dPᵀ Q + (diag(β) dA)ᵀ K + diag(β) d(βK).
        grad_weighted_keys = _dot(grad_system, keys, OPERAND, PRECISION)
        grad_weighted_keys -= _dot(inverse_transposed, grad_new_values_state, OPERAND, PRECISION)
        chunk_grad_key = new_values_grad_state + _dot(tl.trans(grad_scores), queries, OPERAND, PRECISION)
        chunk_grad_key += _dot(tl.trans(grad_system_beta), keys, OPERAND, PRECISION)
        chunk_grad_key += grad_weighted_keys * beta_rows[:, None]
        _store_tile(grad_key + first_row * key_dim, offsets, valid, key_columns, key_dim, chunk_grad_key)
        # (10) the key part of dβ.
        grad_beta_rows += tl.sum(grad_weighted_keys * keys.to(DTYPE), 1)

    if HAS_BETA:
        tl.store(grad_beta + first_row + offsets, _cast(grad_beta_rows, grad_beta.dtype.element_ty), mask=valid)


def _contiguous(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index rows of ``width`` elements: every tensor they read must be contiguous."""
    return None if tensor is None else tensor.contiguous()


def _host_offsets(cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...]) -> list[int]:
    """The packed-sequence offsets given on the host, as a list (no device is touched)."""
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(
                f"cu_seqlens_cpu must be a CPU tensor or a list of ints (a host copy of cu_seqlens), got a tensor on "
                f"{cu_seqlens_cpu.device}."
            )
        return cu_seqlens_cpu.tolist()
    return [int(offset) for offset in cu_seqlens_cpu]


class _Layout:
    """Shapes, chunking, tile sizes and precisions shared by the forward and the backward of one call."""

    def __init__(self, query, key, value, chunk_size, cu_seqlens, host_offsets, compute_dtype):
        batch_size, num_heads, length, key_dim = key.shape
        self.num_heads, self.length, self.key_dim, self.value_dim = num_heads, length, key_dim, value.shape[-1]
        # The chunking does not change the result: chunks longer than MAX_CHUNK_SIZE run as chunks of that size.
        self.chunk_size = min(chunk_size, MAX_CHUNK_SIZE)
        self.dtype = compute_dtype
        self.triton_dtype = _TRITON_DTYPES[compute_dtype]
        # Half-precision inputs keep their dtype for the dot operands and the stored per-token intermediates.
        half = key.dtype in (torch.bfloat16, torch.float16) and query.dtype == key.dtype == value.dtype
        self.storage_dtype = key.dtype if half else compute_dtype
        self.operand = _TRITON_DTYPES[self.storage_dtype]
        exact = compute_dtype == torch.float64 or FLOAT32_PRECISION == "ieee"
        self.precision = "ieee" if compute_dtype == torch.float64 else FLOAT32_PRECISION
        self.inverse_precision = "ieee" if exact else INVERSE_PRECISION
        self.is_varlen = cu_seqlens is not None
        self.target = gpu_target(key.device)
        # Chunks live in tiles of BLOCK_T ≥ 16 rows (a power of two); extra rows are masked.
        self.block_t = max(MIN_BLOCK, triton.next_power_of_2(self.chunk_size))
        full_key = max(MIN_BLOCK, triton.next_power_of_2(key_dim))
        full_value = max(MIN_BLOCK, triton.next_power_of_2(self.value_dim))
        block_width = BLOCK_WIDTH if self.storage_dtype.itemsize == 2 else max(MIN_BLOCK, BLOCK_WIDTH // 2)
        self.block_k = min(full_key, block_width)
        self.block_v = min(full_value, block_width)
        # The chunk backward holds three BLOCK_T × block_k accumulators besides its BLOCK_T × BLOCK_T tiles: half
        # as wide a slice of d_k keeps it from spilling registers on sm_80.
        self.backward_block_k = max(MIN_BLOCK, self.block_k // 2)
        output_width = OUTPUT_BLOCK_WIDTH if self.storage_dtype.itemsize == 2 else OUTPUT_BLOCK_WIDTH // 2
        self.output_block_v = min(full_value, output_width)
        # 4- and 8-byte operands: rows of d_k up to half as wide (a float32 reverse recurrence at d_k = 128 spills).
        register_key_dim = MAX_REGISTER_KEY_DIM if self.storage_dtype.itemsize == 2 else MAX_REGISTER_KEY_DIM // 2
        self.state_in_registers = full_key <= register_key_dim
        self.state_block_k = full_key if self.state_in_registers else self.block_k
        # The forward state tile (state_block_k × state_block_v) is at most STATE_TILE elements (half for 4-byte
        # operands).
        state_tile = STATE_TILE if self.storage_dtype.itemsize == 2 else STATE_TILE // 2
        self.state_block_v = min(full_value, max(MIN_BLOCK, state_tile // self.state_block_k))
        # The reverse recurrence loads Q, K, W and dO per chunk: at most 32 columns of the state keep it from
        # spilling registers on sm_80.
        self.backward_state_block_v = min(self.state_block_v, 2 * MIN_BLOCK)
        # A state held in registers is stored per chunk only for the products that read it: in the operand dtype.
        # A state in global memory is the running state itself: in the compute dtype.
        self.state_storage_dtype = self.storage_dtype if self.state_in_registers else compute_dtype

        if cu_seqlens is None:
            self.num_sequences = batch_size
            self.num_chunks = triton.cdiv(length, self.chunk_size)  # per sequence
            self.total_chunks = batch_size * self.num_chunks
            self.cu_seqlens = self.chunk_indices = self.chunk_offsets = None
        else:
            # Chunk c of all sequences is chunk chunk_indices[c, 1] of sequence chunk_indices[c, 0]; sequence s
            # owns the chunks chunk_offsets[s] .. chunk_offsets[s + 1] − 1. Built on the device; only the number
            # of chunks (the grid size) is needed on the host, from host_offsets when given.
            device = key.device
            self.cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
            self.num_sequences = cu_seqlens.numel() - 1
            counts = (self.cu_seqlens.diff() + self.chunk_size - 1) // self.chunk_size
            self.chunk_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
            if host_offsets is not None:
                self.total_chunks = sum(
                    -(-(end - start) // self.chunk_size) for start, end in zip(host_offsets, host_offsets[1:])
                )
            else:
                self.total_chunks = int(self.chunk_offsets[-1])  # one device-to-host copy
            sequences = torch.repeat_interleave(
                torch.arange(self.num_sequences, device=device), counts, output_size=self.total_chunks
            )
            index = torch.arange(self.total_chunks, device=device) - self.chunk_offsets[sequences]
            self.chunk_indices = torch.stack([sequences, index], dim=1).to(torch.int32).contiguous()
            self.num_chunks = 0  # unused: the chunks are located through the tables above

    def kernel_options(self, kernel: str) -> dict:
        """The compile-time constants every kernel takes and the launch options of ``kernel``."""
        options = {"CHUNK_SIZE": self.chunk_size, "BLOCK_T": self.block_t, "IS_VARLEN": self.is_varlen}
        precision = {"DTYPE": self.triton_dtype, "OPERAND": self.operand, "PRECISION": self.precision}
        if kernel == "output" and self.output_block_v > BLOCK_WIDTH:
            kernel = "output_wide"
        num_warps, num_stages = LAUNCH_OPTIONS[self.target][min(self.storage_dtype.itemsize, 4)][kernel]
        return {**options, **precision, "num_warps": num_warps, "num_stages": num_stages}

    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.num_sequences, self.num_heads, self.key_dim, self.value_dim)

    def arguments(self) -> tuple:
        """The trailing runtime arguments every kernel takes, after its tensors and the chunk tables."""
        return (self.length, self.num_heads, self.num_chunks, self.key_dim, self.value_dim)

    def chunk_grid(self, block_v: int | None = None) -> tuple[int, ...]:
        """(chunk × head) on the first grid axis (up to 2³¹ − 1 programs), slices of ``block_v`` columns of d_v on
        the second if given."""
        grid = (self.total_chunks * self.num_heads,)
        return grid if block_v is None else (*grid, triton.cdiv(self.value_dim, block_v))

    def sequence_grid(self, block_v: int) -> tuple[int, int]:
        """(sequence × head) on the first grid axis, slices of ``block_v`` columns of d_v on the second."""
        return (self.num_sequences * self.num_heads, triton.cdiv(self.value_dim, block_v))


def _forward(query, key, value, beta, initial_state, output_final_state, layout):
    """Eqs. (1)-(5). Returns the output, the final state (or None) and what the backward needs."""
    dtype, storage, device = layout.dtype, layout.storage_dtype, key.device
    inverse = torch.empty(*key.shape[:3], layout.block_t, dtype=storage, device=device)
    scores = torch.empty_like(inverse)
    weights = torch.empty(key.shape, dtype=storage, device=device)
    updates = torch.empty(value.shape, dtype=storage, device=device)
    new_values = torch.empty(value.shape, dtype=storage, device=device)
    states = torch.empty(
        layout.total_chunks, *layout.state_shape()[1:], dtype=layout.state_storage_dtype, device=device
    )
    # A state in global memory leaves the last chunk through final_state, asked for or not.
    need_final_state = output_final_state or not layout.state_in_registers
    final_state = torch.empty(layout.state_shape(), dtype=dtype, device=device) if need_final_state else None
    output = torch.empty_like(value)

    if layout.total_chunks > 0:
        _prepare_chunk_kernel[layout.chunk_grid()](
            query, key, value, beta, inverse, scores, weights, updates, layout.cu_seqlens, layout.chunk_indices,
            *layout.arguments(), BLOCK_K=layout.block_k, BLOCK_V=layout.block_v, HAS_BETA=beta is not None,
            SOLVE_BLOCK=SOLVE_BLOCK, INVERSE_PRECISION=layout.inverse_precision, **layout.kernel_options("prepare"),
        )  # fmt: skip
    _state_forward_kernel[layout.sequence_grid(layout.state_block_v)](
        key, weights, updates, initial_state, states, new_values, final_state, layout.cu_seqlens,
        layout.chunk_offsets, *layout.arguments(), BLOCK_K=layout.state_block_k, BLOCK_V=layout.state_block_v,
        STATE_IN_REGISTERS=layout.state_in_registers, HAS_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=need_final_state, **layout.kernel_options("state"),
    )  # fmt: skip
    if layout.total_chunks > 0:
        _output_kernel[layout.chunk_grid(layout.output_block_v)](
            query, scores, new_values, states, output, layout.cu_seqlens, layout.chunk_indices, *layout.arguments(),
            BLOCK_K=layout.block_k, BLOCK_V=layout.output_block_v, **layout.kernel_options("output"),
        )  # fmt: skip
    return output, (final_state if output_final_state else None), (inverse, scores, weights, new_values, states)


def _backward(query, key, value, beta, saved, grad_output, grad_final_state, need_grad_initial_state, layout):
    """Eqs. (6)-(10). Returns the gradients of query, key, value, beta (or None) and initial state (or None)."""
    inverse, scores, weights, new_values, states = saved
    grad_new_values = torch.empty_like(new_values)
    grad_states = torch.empty_like(states)
    # A gradient in global memory leaves the first chunk through grad_initial_state, asked for or not.
    store_grad_initial_state = need_grad_initial_state or not layout.state_in_registers
    grad_initial_state = None
    if store_grad_initial_state:
        grad_initial_state = torch.empty(layout.state_shape(), dtype=layout.dtype, device=key.device)
    grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    grad_beta = None if beta is None else torch.empty_like(beta)

    _state_backward_kernel[layout.sequence_grid(layout.backward_state_block_v)](
        query, key, weights, scores, grad_output, grad_final_state, grad_states, grad_new_values, grad_initial_state,
        layout.cu_seqlens, layout.chunk_offsets, *layout.arguments(), BLOCK_K=layout.state_block_k,
        BLOCK_V=layout.backward_state_block_v, STATE_IN_REGISTERS=layout.state_in_registers,
        HAS_GRAD_FINAL_STATE=grad_final_state is not None, STORE_GRAD_INITIAL_STATE=store_grad_initial_state,
        **layout.kernel_options("state"),
    )  # fmt: skip
    if layout.total_chunks > 0:
        _chunk_backward_kernel[layout.chunk_grid()](
            query, key, value, beta, inverse, new_values, states, grad_output, grad_states, grad_new_values,
            grad_query, grad_key, grad_value, grad_beta, layout.cu_seqlens, layout.chunk_indices,
            *layout.arguments(), BLOCK_K=layout.backward_block_k, BLOCK_V=layout.block_v, HAS_BETA=beta is not None,
            **layout.kernel_options("chunk_backward"),
        )  # fmt: skip
    return grad_query, grad_key, grad_value, grad_beta, (grad_initial_state if need_grad_initial_state else None)


class DeltaRuleChunkTritonFunction(torch.autograd.Function):
    """The chunkwise delta rule of SPEC §1 in Triton; see the module docstring for the equations."""

    @staticmethod
    def forward(
        ctx, query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens, host_offsets=None
    ):
        query, key, value, beta, initial_state = map(_contiguous, (query, key, value, beta, initial_state))
        compute_dtype = _compute_dtype(query, key, value, beta, initial_state)
        layout = _Layout(query, key, value, chunk_size, cu_seqlens, host_offsets, compute_dtype)
        output, final_state, saved = _forward(query, key, value, beta, initial_state, output_final_state, layout)
        ctx.save_for_backward(query, key, value, beta, *saved)
        ctx.layout = layout
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused output or final state arrives as None
        return output, final_state

    @staticmethod
    def backward(ctx, grad_output, grad_final_state):
        # Own precision: a backward called inside autocast must not turn the float32 state math to half.
        device_type = next((grad.device.type for grad in (grad_output, grad_final_state) if grad is not None), "cpu")
        with torch.autocast(device_type, enabled=False):
            return DeltaRuleChunkTritonFunction._backward(ctx, grad_output, grad_final_state)

    @staticmethod
    def _backward(ctx, grad_output, grad_final_state):
        query, key, value, beta, *saved = ctx.saved_tensors
        layout = ctx.layout
        if grad_output is None:
            grad_output = torch.zeros_like(value)
        need_grad_initial_state = ctx.needs_input_grad[4]
        grad_query, grad_key, grad_value, grad_beta, grad_initial_state = _backward(
            query, key, value, beta, saved, grad_output.contiguous(), _contiguous(grad_final_state),
            need_grad_initial_state, layout,
        )  # fmt: skip
        if grad_initial_state is not None:
            grad_initial_state = grad_initial_state.to(ctx.state_dtype)
        return grad_query, grad_key, grad_value, grad_beta, grad_initial_state, None, None, None, None


def _check_varlen(key, value, initial_state, cu_seqlens, host_offsets) -> None:
    """Raise ``ValueError`` if ``cu_seqlens`` does not describe sequences packed into the batch of one.

    The offsets are read from ``host_offsets`` when given (no device-to-host copy), else from ``cu_seqlens``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-dimensional integer tensor of N + 1 offsets, got dtype {cu_seqlens.dtype} "
            f"and shape {tuple(cu_seqlens.shape)}."
        )
    if key.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed into a batch of one, got key {tuple(key.shape)}.")
    if host_offsets is not None and len(host_offsets) != cu_seqlens.numel():
        raise ValueError(
            f"cu_seqlens_cpu must hold the same {cu_seqlens.numel()} offsets as cu_seqlens, got {len(host_offsets)}."
        )
    offsets = host_offsets if host_offsets is not None else cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != key.shape[2] or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the number of tokens {key.shape[2]} without decreasing, got {offsets}."
        )
    expected = (len(offsets) - 1, key.shape[1], key.shape[3], value.shape[3])
    if initial_state is not None and initial_state.shape != expected:
        raise ValueError(
            f"with cu_seqlens, initial_state must have shape (sequences, heads, key width, value width) = "
            f"{expected}, got {tuple(initial_state.shape)}."
        )


def delta_rule_chunk_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise delta rule in Triton (SPEC §1), differentiable in every tensor input.

    Same arguments and results as ``chunk.delta_rule_chunk``; shapes are not validated here (use
    ``memlm.kernels.delta_rule``), except the packed-sequence layout.

    Args:
        query, key: ``(B, H, T, d_k)``; value: ``(B, H, T, d_v)``; beta: ``(B, H, T)`` or ``None`` (β = 1).
            Any widths d_k, d_v.
        initial_state: ``(B, H, d_k, d_v)`` (``(N, H, d_k, d_v)`` with ``cu_seqlens``) or ``None`` (zeros).
        output_final_state: also return the state after the last token of each sequence.
        chunk_size: tokens per chunk, any positive integer; the kernels use chunks of
            ``min(chunk_size, MAX_CHUNK_SIZE)`` tokens (in tiles padded to a power of two ≥ 16), which gives the
            same result.
        cu_seqlens: ``None``, or ``N + 1`` integer offsets of ``N`` sequences packed back to back along T
            in a batch of one; chunks never straddle a sequence boundary.
        cu_seqlens_cpu: the same offsets on the host (a CPU tensor or a list), if the caller has them: the chunk
            tables are then built without copying anything from the device (no synchronisation).

    Returns:
        The output ``(B, H, T, d_v)`` in the value's dtype and, if ``output_final_state``, the final state
        ``(B, H, d_k, d_v)`` (``(N, H, d_k, d_v)`` with ``cu_seqlens``) in float32 (float64 for float64
        inputs), else ``None``.

    Raises:
        RuntimeError: for CPU tensors unless Triton's interpreter is on (``TRITON_INTERPRET=1``).
        ValueError: if ``cu_seqlens`` (or ``cu_seqlens_cpu``) or, with it, the batch size or ``initial_state``
            do not fit together.
    """
    if not key.is_cuda and isinstance(_output_kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors, got {key.device}; to run them on CPU, set TRITON_INTERPRET=1 "
            "before memlm's Triton kernels are first imported."
        )
    host_offsets = None
    if cu_seqlens is not None:
        host_offsets = None if cu_seqlens_cpu is None else _host_offsets(cu_seqlens_cpu)
        _check_varlen(key, value, initial_state, cu_seqlens, host_offsets)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is a host copy of cu_seqlens; pass cu_seqlens too.")
    return DeltaRuleChunkTritonFunction.apply(
        query, key, value, beta, initial_state, output_final_state, chunk_size, cu_seqlens, host_offsets
    )
