"""From a config to a model factory: ``model.family`` (gpt, llama, deepseek) or ``model.factory`` (a user's model).

Families are named by import path in :mod:`meshtron.families`, exactly like a user's factory, so
nothing here (and nothing that uses this module: the trainer, ``describe``, ``generate``) imports a
model family: GPT is reached the same way as any model a user brings.

A family module provides ``build(cfg: ModelConfig, rngs, *, tensor) -> nnx.Module`` and may
provide ``extra_rules(cfg, tensor) -> {logical name: mesh axis or None}``. A user factory named by
``model.factory=package.module:function`` is called as ``function(cfg: ModelConfig, rngs)``; its
own logical names are mapped with ``model.rules``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError
from meshtron.families import FAMILIES

if TYPE_CHECKING:
    from meshtron.models.contract import ModelFactory


def _family(name: str) -> Any:
    if name not in FAMILIES:
        raise ConfigError(f"model.family: unknown family {name!r}; use one of {', '.join(FAMILIES)} "
                          "or model.factory=package.module:function for your own model")
    return FAMILIES[name].load_module()


def hf_families() -> list[str]:
    """The families with a Hugging Face mapping, the newest first (the order imports try and list them)."""
    return [name for name, family in reversed(FAMILIES.items()) if family.hf_mapping is not None]


def hf_mapping(family: str) -> Any:
    """The Hugging Face mapping module of ``family`` (no JAX, no torch; :mod:`meshtron.models.hf_mapping`
    says what one provides)."""
    if family not in hf_families():
        raise ConfigError(f"model.family: {family!r} has no Hugging Face mapping; families with one: "
                          f"{', '.join(hf_families())}")
    return FAMILIES[family].load_hf_mapping()


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named ``package.module:function``; one clear line if it cannot be found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"model.factory: {spec!r} is not of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"model.factory: cannot import {module_name!r} ({err}); check the name and that "
                          "it is on PYTHONPATH") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"model.factory: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"model.factory: {spec} is not callable; name a function (cfg, rngs) -> model")
    expected = "a function build(model_config, rngs) -> model, called with the run's model config and an nnx.Rngs"
    if inspect.isclass(fn):
        raise ConfigError(f"model.factory: {spec} is a class; name {expected} (it may construct {attr})")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"model.factory: {spec}{inspect.signature(fn)} cannot be called as {attr}(model_config, "
                          f"rngs); name {expected}") from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass
    return fn


def model_factory(cfg: ModelConfig, tensor: int = 1) -> ModelFactory:
    """``rngs -> model`` for a run's model config (``tensor``: the tensor-parallel size, which sets the
    built-in families' vocabulary padding)."""
    if cfg.factory:
        fn = load_factory(cfg.factory)

        def build(rngs):
            return fn(cfg, rngs)

        build.__qualname__ = cfg.factory  # errors name it as the config does
        return build
    build = _family(cfg.family).build
    return lambda rngs: build(cfg, rngs, tensor=tensor)


def family_rules(cfg: ModelConfig, tensor: int = 1) -> dict[str, str | None]:
    """The built-in family's own additions to the rules table for this config and tensor size."""
    if cfg.factory:
        return {}
    extra = getattr(_family(cfg.family), "extra_rules", None)
    return dict(extra(cfg, tensor)) if extra is not None else {}
