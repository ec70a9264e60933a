"""The installed hook: one per process, which the aligned forwards find their contract through."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .refusals import AlignmentRefused

if TYPE_CHECKING:
    from .hook import AlignedMambaHook

_INSTALLED: AlignedMambaHook | None = None


def installed() -> AlignedMambaHook | None:
    """The installed hook, or None."""
    return _INSTALLED


def set_installed(hook: AlignedMambaHook | None) -> None:
    global _INSTALLED
    _INSTALLED = hook


def hook_for(module: Any) -> AlignedMambaHook:
    """The hook ``apply_to_model`` bound to ``module``, else the installed one (the final norm is bound to none)."""
    hook = getattr(module, "_aligned_mamba_hook", None) or _INSTALLED
    if hook is None:
        raise AlignmentRefused("aligned forward called without an installed hook")
    return hook
