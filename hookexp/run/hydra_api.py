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

from hookexp.errors import ConfigError, HookexpError, did_you_mean


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


def hook_files_defining(name: str, config_name: str, overrides: list[str]) -> list[str]:
    """The options of the ``hooks`` group (package or ``--config-dir``) whose file defines spec ``name``."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    _, repo = hydra_private("config_repository")(loader, config_name, overrides)
    found = []
    for option in repo.get_group_options("hooks", ObjectType.CONFIG):
        with contextlib.suppress(Exception):  # a file that does not load defines nothing here
            if name in repo.load_config(f"hooks/{option}").config:
                found.append(str(option))
    return found


def group_options(group: str) -> list[str]:
    """The options of a config group in the running Hydra's search path (none when Hydra is not running)."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return []
    return list(GlobalHydra.instance().config_loader().get_group_options(group))


# What a value of the typed schema must be, from OmegaConf's message (``could not be converted to Integer``).
_TYPE_WORDS = {"Integer": ("a whole number (int)", "3"), "Float": ("a number (float)", "0.1"),
               "bool": ("true or false", "true")}


def explain_hydra_error(error: BaseException) -> ConfigError | None:
    """Hydra's composition errors as hookexp's one paragraph: an unknown option of a config group
    (``hooks=clamp_cnv``) and a value of the wrong type (``trainer.epochs=abc``); None for any other error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ValidationError

    if isinstance(error, MissingConfigException) and "/" in str(error.missing_cfg_file):
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        options = [str(o) for o in error.options or group_options(group)]  # Hydra lists them for a single choice
        if not options:
            return None
        return ConfigError(f"no option {option!r} ({group}/{option}.yaml is in no config folder)."
                           f"{did_you_mean(option, options)} The options: {', '.join(options)} (python -m hookexp "
                           "--help lists every group's).", key=group)
    cause = error.__cause__ if isinstance(error, ConfigCompositionException) else error
    if not isinstance(cause, ValidationError) or not cause.full_key:
        return None
    key, text = str(cause.full_key), str(cause.msg).splitlines()[0]
    value = text.split("'")[1] if text.count("'") >= 2 else "?"
    if "expected one of [" in text:  # an enum
        options = [o.strip() for o in text.rsplit("[", 1)[1].rstrip("]").split(",")]
        return ConfigError(f"{value!r} is not one of its options.{did_you_mean(value, options)} {key} takes one of: "
                           f"{', '.join(options)}.", key=key)
    given = getattr(cause, "value", None)
    if "is not a ListConfig, list or tuple" in text:  # types: Conv2d for types: [Conv2d]
        return ConfigError(f"{given!r} is not a list. {key} takes a list, e.g. {key}=[{given}] ({key}=[] for none).",
                           key=key)
    if text.startswith("Cannot assign") and "Dict[" in text:
        return ConfigError(f"{given!r} is not a mapping. {key} takes a mapping, e.g. {key}={{name:value}} "
                           "(python -m hookexp --cfg job shows the config).", key=key)
    what, example = next((words for name, words in _TYPE_WORDS.items() if name in text.split()[-1] or
                          f"valid {name}" in text), (None, None))
    if what is None:
        return ConfigError(f"{text}. Give {key} a value of its type (python -m hookexp --cfg job shows the config).",
                           key=key)
    hint = did_you_mean(value, ["true", "false"]) if example == "true" else ""
    return ConfigError(f"{value!r} is not {what}.{hint} {key} takes {what}, e.g. {key}={example}.", key=key)


@contextlib.contextmanager
def hydra_errors_as_ours() -> Iterator[None]:
    """While Hydra runs: what :func:`explain_hydra_error` explains is printed as ``hookexp: error: ...`` (exit 2)
    instead of Hydra's report (its message, the config search path, exit 1). Other errors stay Hydra's."""
    import sys

    report = hydra_private("report")

    def run_and_explain(func: Any) -> Any:
        def explained() -> Any:
            try:
                return func()
            except Exception as e:
                ours = explain_hydra_error(e)
                if ours is None:
                    raise
                print(f"hookexp: error: {ours}", file=sys.stderr)
                sys.exit(2)

        return report(explained)

    hydra_private("report", replace=run_and_explain)
    try:
        yield
    finally:
        hydra_private("report", replace=report)


# Hydra's private API, the pieces hookexp needs: the config repository a set of overrides composes from
# (check_hook_files reads the selected hook files), where overrides are applied (unknown_keys_as_additions), and
# where Hydra prints what went wrong while composing (hydra_errors_as_ours).
# They are read and replaced only through hydra_private; tests/run/test_cli.py runs it on the installed Hydra.
HYDRA_PRIVATE = {  # name: (module, class, attribute, its parameters)
    "config_repository": ("hydra._internal.config_loader_impl", "ConfigLoaderImpl",
                          "_parse_overrides_and_create_caching_repo", ("self", "config_name", "overrides")),
    "apply_overrides": ("hydra._internal.config_loader_impl", "ConfigLoaderImpl", "_apply_overrides_to_config",
                        ("overrides", "cfg")),
    "report": ("hydra._internal.utils", "", "run_and_report", ("func",)),  # a module's function: no class
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
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        found = getattr(owner, attr)
        moved = tuple(inspect.signature(found).parameters) != params
    except (ImportError, AttributeError):
        found, moved = None, True
    if moved:
        where = f"{module}.{cls}" if cls else module
        raise HookexpError(f"hookexp uses Hydra's private {where}.{attr}({', '.join(params)}), which "
                           f"hydra-core {hydra.__version__} does not have (a Hydra release moved it). hookexp "
                           f"supports hydra-core{HYDRA_SUPPORTED}: pip install 'hydra-core{HYDRA_SUPPORTED}'.")
    if replace is not None:
        setattr(owner, attr, staticmethod(replace) if cls else replace)
    return found
