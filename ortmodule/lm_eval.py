"""lm-eval backend: `OrtModuleLM`, registered as `ortmodule` when this module is imported.

It is lm-eval's own `HFLM` with an ONNX GenAI package underneath. It overrides only what it
must: config and model built from the package, `max_length` from `genai_config.json`, model info
without network calls, and loglikelihood scoring, which goes through `ortmodule.loglikelihood` so
that only the continuation's positions reach the LM head and the log-softmax and gather run on the
device, with one small copy to the host per batch.
"""

from __future__ import annotations

import atexit
import functools
import threading
from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm

from .hf import build_config
from .inputs import pad_right
from .modeling import OrtModelForCausalLM
from .package import read_package
from .scoring import answers, grouped_loglikelihood_totals, loglikelihood_totals
from .sharing import common_prefix, worth_sharing


def _sharing_choice(value) -> bool | str:
    """`share_contexts`: "auto" (where `sharing.worth_sharing` says it saves time, from this
    model's measured costs), or always / never; lm-eval passes model_args as strings."""
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key not in ("auto", "true", "false"):
        raise ValueError(f"share_contexts must be auto, true or false, got {value!r}")
    return "auto" if key == "auto" else key == "true"


def _texts_to_encode(pairs) -> list[str]:
    """The texts `TemplateLM._encode_pair` tokenizes for (context, continuation) pairs, each once:
    context + continuation, and the context (trailing spaces moved to the continuation)."""
    texts: dict[str, None] = {}
    for context, continuation in pairs:
        if context:
            stripped = context.rstrip()
            texts[context + continuation] = None
            texts[stripped] = None
    return list(texts)


def leave_process_group() -> None:
    """Destroy torch.distributed's default process group, if one is up (as `accelerate launch`
    makes for data parallel). lm-eval never does, and gloo's worker threads still running when the
    interpreter finalizes abort the process at exit ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#190489). Idempotent."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _one_evaluation_at_a_time(method):
    """lm-eval backends keep per-run state (batch-size search, caches): a second thread calling
    into the same backend while it runs gets a clear error instead of a race."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                "this OrtModuleLM is already running requests on another thread; use one OrtModuleLM per "
                "thread (they may share one model: OrtModuleLM(pretrained=model, tokenizer=tokenizer))"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running.release()

    return run


@register_model("ortmodule")
class OrtModuleLM(HFLM):
    """`lm_eval --model ortmodule --model_args pretrained=PACKAGE_DIR,device=cpu` (or cuda, cuda:N).

    Extra model_args: `rewrite_lm_head` (default True), `provider_options` (a dict, from Python),
    `share_contexts` (auto, true or false: run a context shared by several requests once; auto
    where `sharing.worth_sharing` says it saves work).
    `pretrained` may also be an `OrtModelForCausalLM` (then pass `tokenizer=` too).
    """

    AUTO_MODEL_CLASS = transformers.AutoModelForCausalLM

    def __init__(self, pretrained, device: str | None = None, rewrite_lm_head: bool = True,
                 provider_options: dict | None = None, share_contexts: bool | str = "auto", **kwargs):
        self._running = threading.RLock()
        self._encoded: dict[str, list[int]] = {}  # the texts of the loglikelihood call in progress, encoded
        self._share = _sharing_choice(share_contexts)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._ort_options = dict(rewrite_lm_head=rewrite_lm_head, provider_options=provider_options)
        if isinstance(pretrained, Path):
            pretrained = str(pretrained)
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        # HFLM splits requests across `accelerate launch` processes only when it counts several
        # GPUs; ortmodule's sessions run anywhere, so N CPU processes split the work too.
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            # Before the interpreter finalizes (atexit runs while it is whole), for Python callers
            # too; ortmodule-eval also leaves the group when lm-eval returns.
            atexit.unregister(leave_process_group)
            atexit.register(leave_process_group)
            if self._world_size == 1:
                self._rank = accelerator.process_index
                self._world_size = accelerator.num_processes

    def _get_config(self, pretrained: str, **kwargs) -> None:
        self._package = read_package(pretrained)
        self._config = build_config(self._package)

    def _create_model(self, pretrained: str, **kwargs) -> None:
        self._model = OrtModelForCausalLM(self._package, device=self._device, **self._ort_options)

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        if isinstance(self._model, OrtModelForCausalLM):
            return self._model.package.context_length
        return super().max_length

    @_one_evaluation_at_a_time
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """HFLM's, with the texts it will tokenize encoded first in batches, each once: a
        multiple-choice question's context is encoded once for all its choices, not twice for each."""
        self._encoded = self._encode_batched(_texts_to_encode(req.args for req in requests))
        try:
            return HFLM.loglikelihood(self, requests, disable_tqdm)
        finally:
            self._encoded = {}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        known = self._encoded.get(string) if add_special_tokens is None and not kwargs else None
        if known is None:
            return super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs)
        return known[-left_truncate_len:] if left_truncate_len else list(known)

    def _encode_batched(self, texts: list[str]) -> dict[str, list[int]]:
        """`HFLM.tok_encode(text)` of every text, in one tokenizer call per special-token setting
        (the Rust tokenizer's batch: no Python per text, threads where TOKENIZERS_PARALLELISM allows)."""
        bos = self.tokenizer.decode(self.prefix_token_id) if self.prefix_token_id is not None else None
        settings: dict[tuple, list[str]] = {}
        for text in texts:
            # tok_encode's rule: add_bos_token when set, and no special tokens before a text that starts with BOS
            special = {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}
            if bos and text.startswith(bos):
                special = {"add_special_tokens": False}
            settings.setdefault(tuple(special.items()), []).append(text)
        encoded = {}
        for special, group in settings.items():
            encoded.update(zip(group, self.tokenizer(group, **dict(special))["input_ids"]))
        return encoded
    loglikelihood_rolling = _one_evaluation_at_a_time(HFLM.loglikelihood_rolling)
    generate_until = _one_evaluation_at_a_time(HFLM.generate_until)

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": self._model.num_parameters(),
            "model_dtype": str(self._model.dtype),
            "model_revision": None,
            "model_sha": "",
        }

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's semantics (left truncation to max_length + 1, longest first), scored on the device.

        Requests that share a context (a multiple-choice question's choices) run it once when that
        saves work (`sharing.worth_sharing`); the others go through batched prefills."""
        if not isinstance(self._model, OrtModelForCausalLM):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        rows, starts = [], []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            row = (context + continuation)[-(self.max_length + 1):][:-1]
            rows.append(row)
            starts.append(len(row) - len(continuation))
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        # Every batch's answers stay on the device until the end: on CUDA the host builds the next
        # batch while one runs, and reads all the answers back in one copy.
        pending: list[tuple[list[int], torch.Tensor]] = []
        shared = self._shared_context_groups(requests, rows, starts) if isinstance(self.batch_size, int) else []
        for batch in self._group_batches(shared):
            chunk = [i for i, _ in batch]
            pending.append((chunk, grouped_loglikelihood_totals(
                self._model, [rows[i] for i in chunk], [g for _, g in batch], [starts[i] for i in chunk],
                [requests[i][2] for i in chunk])))
            progress.update(len(chunk))
        done = {i for group in shared for i in group}
        rest = [i for i in range(len(requests)) if i not in done]
        pending += self._batched(requests, rows, starts, rest, progress, override_bs)
        progress.close()
        results: list = [None] * len(requests)
        if pending:
            order = [i for chunk, _ in pending for i in chunk]
            for i, answer in zip(order, answers(torch.cat([totals for _, totals in pending], dim=1))):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results

    def _shared_context_groups(self, requests, rows, starts) -> list[list[int]]:
        """Requests with the same context whose rows are worth scoring with it run once."""
        by_context: dict[tuple, list[int]] = {}
        for i, (_, context, _) in enumerate(requests):
            by_context.setdefault(tuple(context), []).append(i)
        # Rows cut on the left to max_length by different amounts (continuations of different
        # lengths after a long context) no longer start alike: those run batched.
        groups = [group for group in by_context.values()
                  if len(group) > 1 and common_prefix([rows[i] for i in group]) > 0]
        if self._share is False or not groups:
            return []
        if self._share is True:
            return groups
        costs = self._model.measured_costs()
        return [group for group in groups
                if worth_sharing([rows[i] for i in group], [starts[i] for i in group], costs, self.batch_size)]

    def _group_batches(self, groups: list[list[int]]):
        """(request, group) pairs in batches of about `batch_size` rows, never splitting a group."""
        batch: list[tuple[int, int]] = []
        for g, group in enumerate(groups):
            if batch and len(batch) + len(group) > self.batch_size:
                yield batch
                batch = []
            batch += [(i, g) for i in group]
        if batch:
            yield batch

    def _batched(self, requests, rows, starts, indices, progress, override_bs) -> list[tuple[list[int], torch.Tensor]]:
        """Right-padded batches, longest first (HFLM's order), one prefill each: per batch, its
        requests and their answers on the device (`loglikelihood_totals`)."""
        # Items shaped like requests, (key, context, continuation), as HFLM's batch-size search reads them.
        items = [(i, requests[i][1], requests[i][2]) for i in indices]
        reordered = Collator(items, sort_fn=lambda item: (-len(rows[item[0]]), tuple(rows[item[0]])))
        auto = self.batch_size == "auto"
        batch_size = self.batch_size if not auto else (override_bs or 0)
        batch_fn = self._batch_scheduler if auto and len(reordered) > 0 and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes = {}
        pad = self.tokenizer.pad_token_id or 0
        pending = []
        for chunk in reordered.get_batched(n=batch_size, batch_fn=batch_fn):
            chunk = [i for i, _, _ in chunk]
            ids, mask = pad_right([rows[i] for i in chunk], pad)
            pending.append((chunk, loglikelihood_totals(self._model, ids, mask, [starts[i] for i in chunk],
                                                        [requests[i][2] for i in chunk])))
            progress.update(len(chunk))
        return pending
