"""lm-eval backend: `OrtModuleLM`, registered as `ortmodule` when this module is imported.

It is lm-eval's own `HFLM` with an ONNX GenAI package underneath. It overrides only what it
must: config and model built from the package, `max_length` from `genai_config.json`, model info
without network calls, and loglikelihood scoring, which goes through `ortmodule.loglikelihood` so
that only the continuation's positions reach the LM head and the log-softmax and gather run on the
device, with one small copy to the host per batch.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm

from .modeling import OrtModelForCausalLM, build_config
from .package import read_package
from .scoring import loglikelihood


@register_model("ortmodule")
class OrtModuleLM(HFLM):
    """`lm_eval --model ortmodule --model_args pretrained=PACKAGE_DIR,device=cpu` (or cuda, cuda:N).

    Extra model_args: `rewrite_lm_head` (default True), `provider_options` (a dict, from Python).
    `pretrained` may also be an `OrtModelForCausalLM` (then pass `tokenizer=` too).
    """

    AUTO_MODEL_CLASS = transformers.AutoModelForCausalLM

    def __init__(self, pretrained, device: str | None = None, rewrite_lm_head: bool = True,
                 provider_options: dict | None = None, **kwargs):
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
        if accelerator is not None and accelerator.num_processes > 1 and self._world_size == 1:
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

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": self._model.num_parameters(),
            "model_dtype": str(self._model.dtype),
            "model_revision": None,
            "model_sha": "",
        }

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's semantics (left truncation to max_length + 1, longest first), scored on the device."""
        if not isinstance(self._model, OrtModelForCausalLM):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        reordered = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])))
        auto = self.batch_size == "auto"
        batch_size = self.batch_size if not auto else (override_bs or 0)
        batch_fn = self._batch_scheduler if auto and len(reordered) > 0 and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes = {}
        pad = self.tokenizer.pad_token_id or 0
        results = []
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        for chunk in reordered.get_batched(n=batch_size, batch_fn=batch_fn):
            rows, starts, targets = [], [], []
            for _, context, continuation in chunk:
                if not context or not continuation:
                    raise ValueError("a loglikelihood request needs a non-empty context and continuation")
                if len(continuation) > self.max_length:
                    raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
                row = (context + continuation)[-(self.max_length + 1):][:-1]
                rows.append(row)
                starts.append(len(row) - len(continuation))
                targets.append(continuation)
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            for (request, _, _), answer in zip(chunk, loglikelihood(self._model, ids, mask, starts, targets)):
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                progress.update(1)
        progress.close()
        return reordered.get_original(results)
