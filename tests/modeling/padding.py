"""Shared by the three models' padding tests: padded batches against each row run alone."""

import torch

LAYOUTS = ("left", "right", "between", "empty_row")


def padding_mask(layout: str, lengths: tuple[int, int, int], width: int) -> torch.Tensor:
    """(3, width) masks with `lengths` real tokens per row: on the right (left padding), on the left, scattered, or
    as `left` with the second row empty."""
    if layout == "empty_row":
        lengths = (lengths[0], 0, lengths[2])
    mask = torch.zeros(3, width, dtype=torch.long)
    generator = torch.Generator().manual_seed(3)
    for row, length in enumerate(lengths):
        if layout == "right":
            mask[row, :length] = 1
        elif layout == "between":
            mask[row, torch.randperm(width, generator=generator)[:length]] = 1
        else:
            mask[row, width - length :] = 1
    return mask


def check_rows_alone(model, mask, pad_token_id: int, prefix_length: int, following_length: int,
                     training: bool = False, before_alone=None, snapshot=None, atol: float = 1e-4):  # fmt: skip
    """After an unpadded prefix, a chunk padded as `mask` and an unpadded continuation: assert that the logits at
    real tokens and the continuation equal each row run alone. `training` runs with gradients (the models' training
    paths); `before_alone()` runs before the rows alone (e.g. to switch the kernel backend). With `snapshot(cache)`,
    returns its result for the batch's cache after the padded chunk and for each row's cache alone at that point.
    `atol`: what float32 round-off may differ by between a row in the batch and alone (other shapes, other sums)."""
    rows = mask.shape[0]
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (rows, prefix_length), generator=generator)
    tokens = torch.randint(0, 256, mask.shape, generator=generator).masked_fill(mask == 0, pad_token_id)
    following = torch.randint(0, 256, (rows, following_length), generator=generator)
    full_mask = torch.cat([torch.ones_like(prefix), mask], 1)
    batch_snapshot, row_snapshots = None, []
    with torch.enable_grad() if training else torch.no_grad():
        cache = model(prefix, use_cache=True).cache
        padded = model(tokens, attention_mask=full_mask, cache=cache, use_cache=True)
        if snapshot is not None:
            batch_snapshot = snapshot(padded.cache)
        continued = model(following, attention_mask=torch.cat([full_mask, torch.ones_like(following)], 1),
                          cache=padded.cache, use_cache=True)  # fmt: skip
        if before_alone is not None:
            before_alone()
        for row in range(rows):
            alone = model(prefix[row : row + 1], use_cache=True)
            real = tokens[row, mask[row].bool()][None]
            if real.shape[1]:
                alone = model(real, cache=alone.cache, use_cache=True)
                torch.testing.assert_close(padded.logits[row, mask[row].bool()], alone.logits[0], atol=atol, rtol=0)
            if snapshot is not None:
                row_snapshots.append(snapshot(alone.cache))
            alone_next = model(following[row : row + 1], cache=alone.cache, use_cache=True)
            torch.testing.assert_close(continued.logits[row], alone_next.logits[0], atol=atol, rtol=0)
    return batch_snapshot, row_snapshots
