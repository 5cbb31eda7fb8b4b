"""Parcae looped language models (see :mod:`parcae.model`).

Importing this package registers the config and model with ``transformers``' Auto classes, so
``AutoModelForCausalLM.from_pretrained(folder)`` loads a saved Parcae model; that is its only effect."""

from transformers import AutoConfig, AutoModelForCausalLM

from .model import INJECTIONS, ParcaeConfig, ParcaeForCausalLM, ParcaeOutput, expected_depths, sample_depths  # noqa: F401

AutoConfig.register(ParcaeConfig.model_type, ParcaeConfig, exist_ok=True)
AutoModelForCausalLM.register(ParcaeConfig, ParcaeForCausalLM, exist_ok=True)
