"""`model.model`, `model.base_model` and `model.get_decoder()`: the package's decoder without its LM
head, called as transformers' backbone module (`LlamaModel`, ...) is: `last_hidden_state`
`[B, T, hidden]`, the final norm's output at every position of the caller's layout.

Code that projects the hidden states itself calls it: trl's fused LM head (its DPO and KTO trainers'
reference models, `add_fused_lm_head`), trl's distillation teacher, embeddings pooled from the last
hidden state. With nothing else asked for, the run is a variant of the graph that returns the final
norm's output and has no LM head (`variants.LAST`): no logits are computed. With
`output_hidden_states`, `output_attentions`, a cache to continue or images, the model's own forward
runs (every layer's hidden states, the LM head at every position) and the last of its hidden states
is the answer.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from . import images, runtime, variants
from .hf import CACHE_NAME
from .package import NotSupportedError

_MEDIA = [field.name for field in dataclasses.fields(images.Media)]  # forward's image and video keywords


class Backbone(torch.nn.Module):
    """The decoder without its LM head, over the sessions of `model` (an `OrtModelForCausalLM`): not a
    submodule of it, so `model.parameters()` and `model.modules()` are unchanged, and it holds no
    parameters of its own. Made at each access of `model.model`; it keeps `model` alive."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "causal_lm", model)  # not registered: the model is not a child of its backbone

    # the model's, as transformers' backbone shares its model's config and sits on its device in its dtype
    config = property(lambda self: self.causal_lm.config)
    device = property(lambda self: self.causal_lm.device)
    dtype = property(lambda self: self.causal_lm.dtype)

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """transformers' backbone's embedding table: `get_input_embeddings()`."""
        return self.causal_lm.get_input_embeddings()

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.causal_lm.get_input_embeddings()

    def __getattr__(self, name: str):
        if name in ("layers", "norm", "rotary_emb"):
            raise NotSupportedError(f"the backbone of an ONNX package has no {name}: the ONNX graph holds the weights; "
                                    "it gives hidden states (last_hidden_state, output_hidden_states=True)")
        return super().__getattr__(name)

    def register_forward_hook(self, *args, **kwargs):
        """Refused, as every hook registration on the backbone: transformers' models run their backbone inside
        forward, so a hook there sees every forward and generate; ortmodule's run the ONNX graph whole and
        never this module, so such a hook would silently never be called."""
        raise NotSupportedError("hooks on model.model: ortmodule's forward and generate run the ONNX graph whole, not "
                                "the backbone as a module, so the hook would never see them; use "
                                "model.model(...).last_hidden_state, or forward's output_hidden_states=True")

    register_forward_pre_hook = register_full_backward_hook = register_full_backward_pre_hook = register_forward_hook

    @runtime.entry_point
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache_position: torch.Tensor | None = None, **kwargs):
        """transformers' backbone output: `BaseModelOutputWithPast(last_hidden_state, past_key_values,
        hidden_states, attentions)` (the last three where asked for), or with `return_dict=False` the
        tuple of the fields that are set. Arguments as `OrtModelForCausalLM.forward` takes them."""
        model = self.causal_lm
        if kwargs.get("labels") is not None:
            raise TypeError("the backbone takes no labels: it has no LM head (model(input_ids, labels=...) gives "
                            "the loss)")
        for name in ("logits_to_keep", "cont_len"):  # the head's positions: transformers' backbone takes and ignores it
            kwargs.pop(name, None)
        every = tuple(bool(getattr(model.config, name, False)) if given is None else bool(given) for name, given in
                      (("output_hidden_states", output_hidden_states), ("output_attentions", output_attentions)))
        plain = not any(every) and past_key_values is None and kwargs.get("cache") is None and \
            all(kwargs.get(name) is None for name in _MEDIA)
        # the class's forward: trl replaces the model's own with one that calls its backbone
        out = type(model).forward(model, input_ids, attention_mask, past_key_values=past_key_values,
                                  use_cache=use_cache, position_ids=position_ids, cache_position=cache_position,
                                  inputs_embeds=inputs_embeds,
                                  output_attentions=every[1],
                                  output_hidden_states=variants.LAST if plain else True, **kwargs)
        states = out.hidden_states
        fields = {"last_hidden_state": states[-1], CACHE_NAME: getattr(out, CACHE_NAME),
                  "hidden_states": states if every[0] else None, "attentions": out.attentions}
        if return_dict is False:
            return tuple(value for value in fields.values() if value is not None)
        return BaseModelOutputWithPast(**fields)


class WithBackbone:
    """transformers' ways to a model's backbone, on `OrtModelForCausalLM` (through hf_surface.py)."""

    @property
    def model(self) -> Backbone:
        """The decoder without its LM head, called as transformers' backbone (`LlamaModel`, ...):
        `model.model(input_ids, attention_mask).last_hidden_state`. Not a submodule."""
        return Backbone(self)

    base_model = model  # transformers' `base_model` is the module named `base_model_prefix`, "model"

    def get_decoder(self) -> Backbone:
        """transformers' `get_decoder()`: the backbone (`model.model`)."""
        return Backbone(self)
