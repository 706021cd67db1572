"""Datasets of the tasks shipped with ortmodule, read from the JSONL files beside this module."""

from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _load(name: str, **kwargs) -> dict:
    return {"test": datasets.Dataset.from_json(str(HERE / f"{name}.jsonl"))}


def arithmetic_mc(**kwargs) -> dict:
    return _load("arithmetic_mc")


def sentences(**kwargs) -> dict:
    return _load("sentences")


def knowledge(**kwargs) -> dict:
    return _load("knowledge")
