"""Turns one step's logits into tokens, all rows at once.

Order of operations, per row::

    raw logits -> repetition / presence / frequency penalties -> (logprobs taken here)
               -> allowed-token mask -> greedy argmax, or
                  temperature -> top_k -> top_p -> min_p -> draw

Logprobs describe the model after penalties but before the mask and
temperature, so they report what the model preferred even where a grammar
forbade it.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1)), which
is exactly a categorical draw. A seeded request draws its E from its own
generator, exactly ``vocab_size`` numbers per sampled token, so its tokens
depend on its seed and its own history only, never on its batch companions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachet.engine.sampling_params import SamplingParams
from cachet.engine.step_plan import SampledToken


@dataclass
class SamplingRow:
    """What the sampler needs about one request that samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Seeded requests only; created once per request and advanced by every draw.
    generator: torch.Generator | None = None
    # [vocab] bool, True where the token is allowed (structured output).
    allowed: torch.Tensor | None = None


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """logits: [len(rows), vocab], one row per request in ``rows`` order."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    logits = apply_penalties(logits.float(), rows)
    want_logprobs = any(r.params.logprobs or r.params.top_logprobs for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = apply_allowed_masks(logits, rows)
    tokens = _choose(logits, rows)
    return _results(tokens, logprobs, rows)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF repetition penalty over prompt + output; OpenAI presence/frequency over output only."""
    device, vocab = logits.device, logits.shape[1]
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        seen = (
            _token_counts([list(r.prompt_token_ids) + list(r.output_token_ids) for r in rows], vocab, device)
            > 0
        )
        penalty = torch.tensor(rep, device=device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        counts = _token_counts([list(r.output_token_ids) for r in rows], vocab, device)
        logits = (
            logits
            - torch.tensor(frequency, device=device)[:, None] * counts
            - torch.tensor(presence, device=device)[:, None] * (counts > 0)
        )
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float occurrence counts. Padding goes to a spare column that is then dropped."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_allowed_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf where a row's mask forbids; only the masked rows are touched (one fill for all of them)."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return logits
    allowed = torch.stack([rows[i].allowed for i in masked]).to(logits.device, torch.bool)  # type: ignore[misc]
    if not bool(allowed.any(dim=1).all()):
        raise ValueError("a logit mask allows no token at all")
    if len(masked) == len(rows):
        return torch.where(allowed, logits, float("-inf"))
    logits = logits.clone()
    logits[masked] = torch.where(allowed, logits[masked], float("-inf"))
    return logits


# How many of a row's most likely tokens its filters are looked for among, in turn, before the
# whole vocabulary is sorted: ``topk`` finds them without sorting the rest. A full sort of 16
# rows x 49,152 logits took longer on a CPU than the default model's whole forward pass
# (62 ms against 2.4 for 256 candidates and 8 for 2,048); top_p = 0.9 (SmolLM2's generation
# default) mostly keeps a few tokens, a flat distribution thousands.
FILTER_CANDIDATES = (256, 2048)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set tokens outside each row's support to -inf. top_k 0, top_p 1, min_p 0 disable a filter.

    top_p keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p (measured after top_k); min_p drops tokens below min_p times the most
    likely token's probability. The most likely token always survives.

    Each filter keeps a prefix of the sorted distribution, so a row whose cut falls among its
    ``FILTER_CANDIDATES`` most likely tokens is decided by those alone; only a batch with a
    row that keeps more (a flat distribution, a large top_k) sorts it all.
    """
    unfiltered = (top_k <= 0) & (top_p >= 1.0) & (min_p <= 0.0)
    decided = _decided_among_candidates(logits, top_k, top_p, min_p, unfiltered)
    if decided is not None:
        top_logits, order, remove = decided
        kept = torch.full_like(logits, float("-inf")).scatter_(
            1, order, top_logits.masked_fill(remove, float("-inf"))
        )
        return torch.where(unfiltered[:, None], logits, kept)
    return _filtered_by_sorting(logits, top_k, top_p, min_p)


def _filtered_by_sorting(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = _removed_suffix(sorted_logits, top_k, top_p, min_p)
    return logits.masked_fill(torch.empty_like(remove).scatter_(1, order, remove), float("-inf"))


def _decided_among_candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    unfiltered: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(candidates' logits, their columns, which the filters drop) for the first candidate
    width where every filtered row's cut falls among them; None where some row keeps more."""
    vocab = logits.shape[1]
    log_normalizer = None
    for width in FILTER_CANDIDATES:
        if width < int(top_k.max()) or width >= vocab:
            continue
        if log_normalizer is None:
            log_normalizer = torch.logsumexp(logits, -1, keepdim=True)
        top_logits, order = logits.topk(width, dim=-1)
        remove = _removed_suffix(top_logits, top_k, top_p, min_p, log_normalizer)
        if bool((remove.any(dim=-1) | unfiltered).all()):
            return top_logits, order, remove
    return None


def kept_columns(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_top_k_top_p_min_p`` over the columns some row keeps: (columns, ascending; each
    row's logits there, -inf where it drops the token).

    Where every row is filtered and cut among its ``FILTER_CANDIDATES`` most likely tokens, the
    kept tokens are placed straight into those few columns: building the vocabulary-wide tensor
    and scanning it back took most of a sampled step's filtering (16 x 49,152 at top_p 0.9).
    """
    unfiltered = (top_k <= 0) & (top_p >= 1.0) & (min_p <= 0.0)
    if bool(unfiltered.any()):
        full = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    elif (decided := _decided_among_candidates(logits, top_k, top_p, min_p, unfiltered)) is not None:
        top_logits, order, remove = decided
        columns = order[~remove].unique()
        # A dropped token goes to a spare last column, so it never lands on a kept one.
        place = torch.searchsorted(columns, order).masked_fill_(remove, columns.shape[0])
        kept = logits.new_full((logits.shape[0], columns.shape[0] + 1), float("-inf"))
        return columns, kept.scatter_(1, place, top_logits)[:, :-1]
    else:
        full = _filtered_by_sorting(logits, top_k, top_p, min_p)
    columns = torch.isfinite(full).any(dim=0).nonzero().squeeze(1)
    return columns, full[:, columns]


def _removed_suffix(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    log_normalizer: torch.Tensor | None = None,
) -> torch.Tensor:
    """True where a filter drops the token, over a row's most likely tokens in order (all of
    them, or a prefix with ``log_normalizer``, the logsumexp of the whole row, to weigh them)."""
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=sorted_logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, width)[:, None]
    remove = ranks >= k
    masked = sorted_logits.masked_fill(remove, float("-inf"))
    probs = masked.softmax(dim=-1)
    if log_normalizer is not None:
        # Without top_k a row's mass is over the whole vocabulary, not the prefix.
        probs = torch.where((top_k > 0)[:, None], probs, (masked - log_normalizer).exp())
    # A row at top_p == 1 must keep everything: rounding can push cumsum past 1.0.
    p = torch.where(top_p < 1.0, top_p, 2.0)[:, None]
    remove |= (probs.cumsum(dim=-1) - probs) >= p
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False
    return remove


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first one on ties (as ``torch.argmax``).

    On a CPU, numpy's reduction: torch's CPU argmax over vocabulary-wide rows measured 14x
    slower on this project's hosts (32 x 49,152 fp32: 2.0 ms against 0.15 ms), and a greedy
    step pays it once per step, more than the rest of sampling together.
    """
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.detach().contiguous().numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def _choose(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    tokens = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return tokens
    device = logits.device
    params = [rows[i].params for i in random_rows]
    scaled = logits[random_rows] / torch.tensor([p.temperature for p in params], device=device)[:, None]
    columns = None
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        # Filtered rows keep a few of their most likely tokens: the draw runs over the columns
        # some row keeps, not the vocabulary (16 rows x 49,152 draws cost more than the filters).
        columns, scaled = kept_columns(
            scaled,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device),
        )
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, i in enumerate(random_rows):
        generator = rows[i].generator
        if generator is not None:
            # A whole vocabulary's draws, as skip_draws replays: a seeded token depends on its
            # seed and its own history only, whatever the other rows keep.
            drawn = torch.empty(logits.shape[1], dtype=probs.dtype, device=device).exponential_(
                generator=generator
            )
            noise[row] = drawn if columns is None else drawn[columns]
    # A zero draw would turn 0/0 into NaN for a filtered token; clamp keeps it 0/tiny = 0.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    chosen = argmax_rows(probs / noise)
    tokens[random_rows] = chosen if columns is None else columns[chosen]
    return tokens


def _results(
    tokens: torch.Tensor, logprobs: torch.Tensor | None, rows: Sequence[SamplingRow]
) -> list[SampledToken]:
    token_list: list[int] = tokens.tolist()
    if logprobs is None:
        return [SampledToken(token_id=t) for t in token_list]
    chosen: list[float] = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    n = max(r.params.top_logprobs for r in rows)
    top_values, top_ids = logprobs.topk(n, dim=-1) if n else (None, None)
    top_v = top_values.tolist() if top_values is not None else []
    top_i = top_ids.tolist() if top_ids is not None else []
    results = []
    for i, (row, token) in enumerate(zip(rows, token_list, strict=True)):
        wants = row.params.logprobs or row.params.top_logprobs > 0
        k = row.params.top_logprobs
        results.append(
            SampledToken(
                token_id=token,
                logprob=chosen[i] if wants else None,
                top_logprobs=tuple(zip(top_i[i][:k], top_v[i][:k], strict=True)) if k else (),
            )
        )
    return results


def skip_draws(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Advance a seeded request's generator past ``num_tokens`` random samples.

    A preempted request comes back with its earlier output; replaying the draws
    it already made (same calls, same shapes as ``_choose``) makes the resumed
    stream identical to one that was never interrupted.
    """
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_tokens):
        scratch.exponential_(generator=generator)
