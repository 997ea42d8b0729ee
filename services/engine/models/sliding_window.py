"""A step's attention metadata for sliding-window layers, derived from the one every layer shares.

A sliding layer's query at position ``p`` sees keys ``p - window + 1 .. p`` only. Groups read in
place by the paged kernel get the window from the layer's attention (``PagedAttention.window``);
the groups SDPA attends come from here, with the band as their mask. The KV cache keeps every key
(global layers need them all), and slot mapping and block tables are the step's own.

A banded group still gathers all of its requests' keys and masks the ones behind the window
(prompt chunks where SDPA runs prefill); groups whose longest request fits in the window are
passed through untouched.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cachet.engine.attention import AttentionGroup, AttentionMetadata


def sliding_window_metadata(
    meta: AttentionMetadata, positions: torch.Tensor, window: int
) -> AttentionMetadata:
    """``meta`` with every group SDPA attends that holds more than ``window`` keys masked to the
    band (``positions``: the step's [T] token positions); ``meta`` itself where none does."""
    in_place = meta.decode_in_place

    def needs_band(group: AttentionGroup) -> bool:
        return group.max_kv_len > window and not (in_place and group.max_query_len == 1)

    if not any(needs_band(group) for group in meta.groups):
        return meta
    groups = [_banded(group, positions, window) if needs_band(group) else group for group in meta.groups]
    return replace(meta, groups=groups)


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
