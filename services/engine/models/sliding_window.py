"""A step's attention metadata for sliding-window layers, derived from the one every layer shares.

A sliding layer's query at position ``p`` sees keys ``p - window + 1 .. p`` only. The paged
attention has no window of its own, so the model derives, once per step, metadata whose groups
carry that band as their mask, and hands it to its sliding layers; the KV cache keeps every key
(global layers need them all), and slot mapping and block tables are the step's own.

Correct, not yet fast: a windowed group still gathers all of its requests' keys and masks the
ones behind the window, and a windowed decode goes through SDPA rather than the paged decode
kernel (which has no mask). Groups whose longest request fits in the window are passed through
untouched, so prompts shorter than the window keep every fast path; the first group that needs
the band turns the step's in-place decodes into masked ones too, since the attention decides
between the kernel and SDPA for the whole step (``AttentionMetadata.decode_in_place``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cachet.engine.attention import AttentionGroup, AttentionMetadata


def sliding_window_metadata(
    meta: AttentionMetadata, positions: torch.Tensor, window: int
) -> AttentionMetadata:
    """``meta`` with every group that holds more than ``window`` keys masked to the band
    (``positions``: the step's [T] token positions); ``meta`` itself where none does."""
    if all(group.max_kv_len <= window for group in meta.groups):
        return meta
    in_place = meta.decode_in_place
    groups = [
        _banded(group, positions, window)
        if group.max_kv_len > window or (in_place and group.max_query_len == 1)
        else group
        for group in meta.groups
    ]
    return replace(meta, groups=groups, decode_in_place=False)


def _banded(group: AttentionGroup, positions: torch.Tensor, window: int) -> AttentionGroup:
    """The group with mask ``q - window < k <= q`` for each query row's position ``q``.

    Padding rows of a request (past its query length) take its last position, as the causal mask
    does, so every row sees at least one key."""
    device = group.seq_lens.device
    rows = (group.seq_lens - 1)[:, None].expand(group.batch_size, group.max_query_len).clone()
    rows.view(-1)[group.padded_index] = positions[group.token_index].to(rows.dtype)
    keys = torch.arange(group.max_kv_len, device=device)[None, None, :]
    query = rows[:, :, None]
    mask = (keys <= query) & (keys > query - window)
    return replace(group, mask=mask[:, None], causal=False)
