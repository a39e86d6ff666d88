"""Runtime support for type parameters that have defaults.

Type checkers read the defaults from ``typing_extensions.TypeVar``
(PEP 696); at run time, on Pythons without them and without a dependency
on ``typing_extensions``, `Padded` fills the defaulted trailing parameters
with `Any`, so ``Table[State, Event]`` works as it always has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar


class Padded:
    """Mixin before ``Generic[...]``: trailing parameters default to Any.

    ``_defaulted`` says how many trailing parameters have defaults.
    """

    __slots__ = ()
    _defaulted: ClassVar[int] = 1

    if not TYPE_CHECKING:

        def __class_getitem__(cls, params: object) -> object:
            if not isinstance(params, tuple):
                params = (params,)
            missing = len(cls.__parameters__) - len(params)
            if 0 < missing <= cls._defaulted:
                params = (*params, *([Any] * missing))
            return super().__class_getitem__(params)
