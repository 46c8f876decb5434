"""Composing a run's config with Hydra: the checks Hydra has no hook for, and the only place hookexp touches
Hydra's private API (:func:`hydra_private`, tested on the installed Hydra by tests/run/test_cli.py).

Imports Hydra and OmegaConf only (no torch): the CLI calls it before a run starts, and
:func:`hookexp.run.compose` (the Python API) as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig

from hookexp.errors import ConfigError, HookexpError


def check_hook_files(config_name: str, overrides: list[str]) -> None:
    """Two selected hook files that define the same spec name would be merged by Hydra, the later silently
    winning: refuse that, naming both files."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    # the repository with the search path the overrides give (hydra.searchpath, as compose(config_dir=) adds it)
    _, repo = hydra_private("config_repository")(loader, config_name, overrides)
    owner: dict[str, str] = {}
    for default in loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults:
        path = default.config_path or ""
        if not path.startswith("hooks/"):
            continue
        for name in repo.load_config(path).config:
            if owner.get(name) == path:
                raise ConfigError(f"{path}.yaml is selected twice; select each hook file once.", key="hooks")
            if name in owner:
                raise ConfigError(f"spec {name!r} is defined by two hook files, {owner[name]}.yaml and {path}.yaml; "
                                  "Hydra would merge them and the second would silently replace the first. Rename "
                                  "the spec in one of them (a spec name is unique in a run).", key=f"hooks.{name}")
            owner[str(name)] = path


@contextlib.contextmanager
def unknown_keys_as_additions() -> Iterator[None]:
    """While Hydra composes: an override of a key the config lacks (``trainer.max_step=20``) is applied as
    ``+trainer.max_step=20``, so that hookexp's checks answer the typo with their did-you-mean instead of Hydra's
    advice to add it (``hydra.*`` keys stay Hydra's). Hydra offers no hook there: this replaces a private one."""
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    apply = hydra_private("apply_overrides")

    def apply_each(overrides: list[Any], cfg: DictConfig) -> None:
        for override in overrides:
            try:
                apply([override], cfg)
            except ConfigCompositionException as e:
                if (override.type != OverrideType.CHANGE or override.key_or_group.startswith("hydra.")
                        or not isinstance(e.__cause__, (ConfigAttributeError, ConfigKeyError))):
                    raise
                apply([dataclasses.replace(override, type=OverrideType.FORCE_ADD)], cfg)

    hydra_private("apply_overrides", replace=apply_each)
    try:
        yield
    finally:
        hydra_private("apply_overrides", replace=apply)


# Hydra's private API, the two pieces hookexp needs: the config repository a set of overrides composes from
# (check_hook_files reads the selected hook files), and where overrides are applied (unknown_keys_as_additions).
# They are read and replaced only through hydra_private; tests/run/test_cli.py runs it on the installed Hydra.
HYDRA_PRIVATE = {  # name: (module, class, attribute, its parameters)
    "config_repository": ("hydra._internal.config_loader_impl", "ConfigLoaderImpl",
                          "_parse_overrides_and_create_caching_repo", ("self", "config_name", "overrides")),
    "apply_overrides": ("hydra._internal.config_loader_impl", "ConfigLoaderImpl", "_apply_overrides_to_config",
                        ("overrides", "cfg")),
}
HYDRA_SUPPORTED = ">=1.3.2,<1.4"  # the hydra-core versions this is written for: pyproject.toml's requirement


def hydra_private(name: str, replace: Any = None) -> Any:
    """The private Hydra function ``HYDRA_PRIVATE[name]``; with ``replace``, install that (a static method) in its
    place and return the one it replaced. A ``HookexpError`` naming the installed hydra-core and the supported
    versions when the function is gone or takes other parameters (a Hydra release moved it)."""
    import importlib
    import inspect

    module, cls, attr, params = HYDRA_PRIVATE[name]
    try:
        owner = getattr(importlib.import_module(module), cls)
        found = getattr(owner, attr)
        moved = tuple(inspect.signature(found).parameters) != params
    except (ImportError, AttributeError):
        found, moved = None, True
    if moved:
        raise HookexpError(f"hookexp uses Hydra's private {module}.{cls}.{attr}({', '.join(params)}), which "
                           f"hydra-core {hydra.__version__} does not have (a Hydra release moved it). hookexp "
                           f"supports hydra-core{HYDRA_SUPPORTED}: pip install 'hydra-core{HYDRA_SUPPORTED}'.")
    if replace is not None:
        setattr(owner, attr, staticmethod(replace))
    return found
