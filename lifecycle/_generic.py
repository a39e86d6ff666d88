"""Runtime support for type parameters that have defaults.

Type checkers read the defaults from ``typing_extensions.TypeVar``
(PEP 696); at run time, on Pythons without them and without a dependency
on ``typing_extensions``, `Padded` fills the defaulted trailing parameters
with `Any`, so ``Table[State, Event]`` works as it always has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar


class Padded:
    """Mixin before ``Generic[...]``: trailing parameters get defaults.

    ``_defaults`` are the run-time defaults of the trailing parameters
    (Any unless a class says otherwise).
    """

    __slots__ = ()
    _defaults: ClassVar[tuple[object, ...]] = (Any,)

    if not TYPE_CHECKING:

        def __class_getitem__(cls, params: object) -> object:
            if not isinstance(params, tuple):
                params = (params,)
            missing = len(cls.__parameters__) - len(params)
            if 0 < missing <= len(cls._defaults):
                params = (*params, *cls._defaults[-missing:])
            return super().__class_getitem__(params)
