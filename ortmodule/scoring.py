"""Scoring on the device: continuation log-likelihoods from one forward per batch.

The LM head runs only at the positions that predict a target token, the log-softmax (float32)
and the gather happen on `model.device`, and one small tensor per batch comes back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .modeling import OrtModelForCausalLM


@torch.inference_mode()
def loglikelihood(
    model: OrtModelForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    starts: Sequence[int],
    targets: Sequence[Sequence[int]],
) -> list[tuple[float, bool]]:
    """Per row: the sum of log p(target) and whether every target is the greedy token.

    Row i's targets are predicted by the logits at positions `starts[i], starts[i] + 1, ...` of the
    padded input (for a row holding context + continuation[:-1], `starts[i] = len(context) - 1`).
    """
    batch = input_ids.shape[0]
    if len(starts) != batch or len(targets) != batch:
        raise ValueError(f"starts and targets need one entry per row: {batch} rows, got {len(starts)} and {len(targets)}")
    counts = [len(t) for t in targets]
    if min(counts) == 0:
        raise ValueError(f"row {counts.index(0)} has no target tokens")
    vocab = model.config.vocab_size
    flat_targets = [t for row in targets for t in row]
    bad = next((t for t in flat_targets if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"target token id {bad} is outside the vocabulary [0, {vocab})")
    rows = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts))
    cols = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
    device = model.device
    rows, cols = rows.to(device), cols.to(device)
    target = torch.tensor(flat_targets, device=device)

    logits = model.logits_at(input_ids, attention_mask, rows, cols)  # [n, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, target[:, None]).squeeze(1)
    misses = (logits.argmax(-1) != target).float()
    sums = torch.zeros(batch, device=device).index_add_(0, rows, logprobs)
    missed = torch.zeros(batch, device=device).index_add_(0, rows, misses)
    summary = torch.stack([sums, missed]).cpu()  # the one device-to-host copy
    return [(s, m == 0) for s, m in zip(summary[0].tolist(), summary[1].tolist())]
