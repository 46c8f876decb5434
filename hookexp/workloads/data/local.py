"""What the factories that read local files share: paths relative to where hookexp was started (Hydra may
change the working directory), optional packages named by their extra, and local HF tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookexp.errors import ConfigError, did_you_mean


def _base_dir() -> Path:
    """Where a relative path is read from: the directory the user ran hookexp in (Hydra may change cwd)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.cwd)
    except Exception:
        pass
    return Path.cwd()


def _resolve(path: Any) -> Path:
    """A path from the config: absolute, or relative to where hookexp was started."""
    resolved = Path(str(path)).expanduser()
    return resolved if resolved.is_absolute() else _base_dir() / resolved


def _existing(path: Any, key: str, what: str) -> Path:
    if path is None or path == "":
        raise ConfigError(f"is not set; give {what}.", key=key)
    base = _base_dir()
    resolved = _resolve(path)
    if not resolved.exists():
        raise ConfigError(f"{str(path)!r} does not exist (looked in {resolved.parent}). Give {what}, relative to "
                          f"{base} or absolute.", key=key)
    return resolved


def _import(name: str, key: str, purpose: str) -> Any:
    """Import an optional package, or a ConfigError naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{purpose} needs the `{name}` package, which is not installed ({e}). Install the extra: "
                          f"pip install 'hookexp[hf]' (or pip install {name}).", key=key) from None


def _hf_tokenizer(tokenizer: Any, key: str) -> Any:
    """A local HF tokenizer folder, loaded without network access."""
    if not isinstance(tokenizer, (str, Path)):
        raise ConfigError(f"must be 'char' or a local tokenizer folder, got {tokenizer!r}.", key=key)
    folder = _resolve(tokenizer)
    if not folder.is_dir():
        raise ConfigError(f"{str(tokenizer)!r} is neither 'char' nor an existing folder (looked in {folder.parent})."
                          f"{did_you_mean(str(tokenizer), ['char'])} Use char, or a folder written by a "
                          "tokenizer's save_pretrained (nothing is downloaded).", key=key)
    transformers = _import("transformers", key, "a HF tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ConfigError(f"could not load a tokenizer from {folder}: {type(e).__name__}: {e}. Give a folder written "
                          "by tokenizer.save_pretrained(...), or char.", key=key) from None
