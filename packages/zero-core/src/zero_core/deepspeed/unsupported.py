"""What the DeepSpeed facade cannot honour, refused by name.

A DeepSpeed feature the engine lacks (MoE, the pipeline engine, fused kernels, ...) or an
option whose non-default value would change what the engine does is never ignored: it
raises :class:`UnsupportedFeatureError` naming the feature and, where one exists, what to
do instead. The error is a ``NotImplementedError`` and an ``ImportError``, so
``from zero_core.deepspeed.pipe import PipelineModule`` stops with this message rather
than Python's "cannot import name".
"""

from __future__ import annotations

from typing import Any


class UnsupportedFeatureError(NotImplementedError, ImportError):
    """A DeepSpeed feature or option that zero_core's facade does not provide."""


def unsupported(feature: str, advice: str = "") -> UnsupportedFeatureError:
    """The error for ``feature``: ``advice`` says what to do instead."""
    tail = f": {advice}" if advice else ""
    return UnsupportedFeatureError(f"{feature} is not supported by zero_core.deepspeed{tail}")


def refuse_unless_default(call: str, options: dict[str, tuple[Any, Any, str]]) -> None:
    """Raise for the first option of ``call`` given a value other than its default.

    ``options``: name -> (value given, the only value honoured, what to do instead). Values
    are compared with ``==``, so an option passed at its default changes nothing and is
    accepted."""
    for name, (value, honoured, advice) in options.items():
        if value != honoured:
            raise unsupported(f"{call}({name}={value!r})", advice)


def refusing_module_getattr(package: str, feature: str, advice: str) -> Any:
    """A module ``__getattr__`` (PEP 562) that refuses every public name of ``package``
    (dunder lookups stay AttributeErrors, as the import system expects)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise unsupported(f"{package}.{name} ({feature})", advice)

    return __getattr__
