"""The Hugging Face objects a package stands for: its config, generation config and tokenizer,
read from the package's own files (a Hub repository's package is fetched first: hub.py)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import hub
from .package import Package, PackageError

# The name transformers gives the KV cache in model outputs and in generate's model inputs: `cache`
# from transformers 5.24, `past_key_values` before. forward and generate take either name.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def load_tokenizer(path: str | Path, subfolder: str | None = None, revision: str | None = None, **kwargs):
    """The package's Hugging Face fast tokenizer, read from its own files (a Hub repository's package:
    fetched first, as `from_pretrained` fetches it, hub.py)."""
    root = hub.resolve(path, subfolder, revision)
    if not (root / "tokenizer.json").is_file():
        raise PackageError(f"{root}: no tokenizer.json in the package folder")
    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001  tokenizers' and transformers' own errors for a damaged file
        raise PackageError(
            f"{root}: the tokenizer files cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from None


def build_config(package: Package) -> PretrainedConfig:
    """The package's config.json when present, else a config built from what genai_config.json says."""
    config_file = package.root / "config.json"
    if config_file.is_file():
        try:
            return AutoConfig.from_pretrained(package.root, local_files_only=True)
        except (ValueError, KeyError):  # a model type this transformers does not know
            return PretrainedConfig.from_dict(json.loads(config_file.read_text()))
    fields = dict(  # noqa: C408  transformers' config field names as keywords
        vocab_size=package.vocab_size,
        hidden_size=package.hidden_size,
        num_hidden_layers=package.num_hidden_layers,
        num_attention_heads=package.num_attention_heads,
        num_key_value_heads=package.num_key_value_heads,
        head_dim=package.head_size,
        max_position_embeddings=package.context_length,
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
    )
    try:
        config = AutoConfig.for_model(package.model_type, **fields)
    except (ValueError, KeyError, TypeError):
        config = PretrainedConfig(**fields)
    config.name_or_path = str(package.root)
    return config


def build_generation_config(package: Package) -> GenerationConfig:
    """genai_config.json's search section as transformers' GenerationConfig."""
    search = package.search
    return GenerationConfig(
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
        do_sample=search.get("do_sample", False),
        temperature=search.get("temperature", 1.0),
        top_k=search.get("top_k", 50),
        top_p=search.get("top_p", 1.0),
    )
