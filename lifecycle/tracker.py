"""The per-request record a lifecycle machine drives, and how to extend it.

A tracker is plain data: it never holds bound methods, a lock or a reference
to the machine, so dropping the last reference frees it at once (no reference
cycles, no reliance on the cycle collector).  The base holds only what every
lifecycle needs: the request id, the state and the epoch.

Declare your own tracker with `define_tracker`, redeclaring ``state`` with
your enum and its initial state as the default::

    @define_tracker
    class PTracker(Tracker[PState]):
        state: PState = PState.WAITING
        peer: str = ""

`define_tracker` is `attrs.define` with the options the machine relies on:
slots (small, no ``__dict__``), identity equality (trackers are never
equal by value) and no ``on_setattr`` hooks (a plain slot store on the hot
path: with hooks every event costs about 2.4 times more).  `Registry`
refuses a tracker class that lacks any of these (`check_tracker_class`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Generic,
    dataclass_transform,
    overload,
)

import attrs

from lifecycle._generic import Padded

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    K = TypeVar("K", covariant=True, default=str)  # noqa: PLC0105
else:
    from typing import TypeVar

    K = TypeVar("K", covariant=True)  # noqa: PLC0105

S = TypeVar("S", bound=enum.Enum)
C = TypeVar("C", bound=type)

MAX_REQ_ID_LEN = 1024


def _check_req_id(
    inst: object, _attr: attrs.Attribute[Any], v: object
) -> None:
    key_type = getattr(type(inst), "key_type", None)
    if key_type is not None and not isinstance(v, key_type):
        msg = f"req_id must be a {key_type.__name__}, got {type(v).__name__}"
        raise TypeError(msg)
    if not isinstance(v, str):
        if v is None or isinstance(v, (bool, float)):
            msg = f"req_id must be a str or a hashable key, got {v!r}"
            raise TypeError(msg)
        try:
            hash(v)
        except TypeError:
            msg = f"req_id must be hashable, got {type(v).__name__}"
            raise TypeError(msg) from None
        return
    if not v or len(v) > MAX_REQ_ID_LEN:
        msg = f"req_id must have 1..{MAX_REQ_ID_LEN} characters, got {len(v)}"
        raise ValueError(msg)


def check_count(_inst: object, attr: attrs.Attribute[int], v: int) -> None:
    """attrs validator: a non-negative int (bools refused)."""
    if type(v) is not int or v < 0:
        msg = f"{attr.name} must be a non-negative int, got {v!r}"
        raise ValueError(msg)


def _check_state(
    _inst: object, _attr: attrs.Attribute[Any], v: object
) -> None:
    if not isinstance(v, enum.Enum):
        msg = f"'state' must be an enum member, got {v!r}"
        raise TypeError(msg)


@dataclass_transform(field_specifiers=(attrs.field, attrs.Factory))
def _define(cls: C) -> C:
    built: C = attrs.define(
        cls, slots=True, eq=False, on_setattr=attrs.setters.NO_OP
    )
    return built


@_define
class Tracker(Padded, Generic[S, K]):
    """One request's lifecycle: its state and epoch, nothing else.

    Type parameters: the state enum ``S`` and the key type ``K`` (``str``
    by default; any hashable, e.g. an int block hash).

    Fields are validated at construction; afterwards only the lifecycle
    machine changes `state` (and callbacks `epoch`).

    Attributes:
        req_id: The key: a request id (1..1024 characters) or another
            hashable (not None, a bool or a float).  Not an identity
            across preemptions or reuse: see `epoch`.
        state: The current state.  Subclasses redeclare it with their
            enum and the initial state as default.
        epoch: Incremented by the lifecycle's own callbacks (e.g. at a
            preemption).  Transfer jobs carry the epoch they were issued
            in, so a completion from an older epoch is recognised as
            stale (`LifecycleMachine.fire` with ``epoch=``).  A `Registry`
            starts the tracker of a reused key above its predecessor's
            epoch.
    """

    if TYPE_CHECKING:
        __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]

    _defaults = (str,)  # K defaults to str (see `Padded`)
    key_type: ClassVar[type | None] = None
    """The class of `req_id` (None: any hashable).  `define_tracker` sets
    it from the key parameter: ``Tracker[S]`` is ``str``-keyed,
    ``Tracker[S, int]`` int-keyed."""

    req_id: K = attrs.field(validator=_check_req_id)
    state: S = attrs.field(validator=_check_state)
    epoch: int = attrs.field(default=0, validator=check_count, kw_only=True)


@overload
def define_tracker(cls: C, /) -> C: ...


@overload
def define_tracker() -> Callable[[C], C]: ...


@dataclass_transform(field_specifiers=(attrs.field, attrs.Factory))
def define_tracker(cls: C | None = None, /) -> C | Callable[[C], C]:
    """Declare a `Tracker` subclass with the fast, safe attrs options.

    Use as ``@define_tracker`` (or ``@define_tracker()``) on a subclass of
    `Tracker`.  Every added field needs a default.

    Raises:
        TypeError: `cls` is not a `Tracker` subclass.
    """

    def wrap(klass: C) -> C:
        if not (isinstance(klass, type) and issubclass(klass, Tracker)):
            msg = f"{klass!r} is not a subclass of lifecycle.Tracker"
            raise TypeError(msg)
        built = _define(klass)
        built.key_type = _key_type(built)
        check_tracker_class(built)
        return built

    return wrap if cls is None else wrap(cls)


def _key_type(cls: type) -> type | None:
    """The key class a `Tracker[S, K]` subclass declares (default str)."""
    for base in getattr(cls, "__orig_bases__", ()):
        origin = getattr(base, "__origin__", None)
        if isinstance(origin, type) and issubclass(origin, Tracker):
            args: tuple[object, ...] = getattr(base, "__args__", ())
            key = args[1] if len(args) > 1 else str
            return key if isinstance(key, type) else None
    return getattr(cls, "key_type", None)


def slow_reasons(cls: type) -> list[str]:
    """Why trackers of `cls` would be slow or unsafe (empty: fine)."""
    reasons = []
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        return [f"{cls!r} is not a subclass of lifecycle.Tracker"]
    if not attrs.has(cls):
        reasons.append("it is not an attrs class")
    with_dict = _dict_classes(cls)
    if with_dict:
        reasons.append(
            f"{', '.join(with_dict)} has no __slots__ (a __dict__ per tracker)"
        )
    if cls.__setattr__ is not object.__setattr__:
        reasons.append("it hooks attribute assignment (on_setattr)")
    if cls.__eq__ is not object.__eq__:
        reasons.append("it compares by value (eq=True)")
    return reasons


def _dict_classes(cls: type) -> list[str]:
    """The classes that give instances of `cls` a ``__dict__`` (or none).

    An instance has a ``__dict__`` exactly when its class's
    ``__dictoffset__`` is not 0.  The culprits named are the classes of
    the MRO that have a ``__dict__`` slot and either declare no
    ``__slots__`` or list ``"__dict__"`` in them.  A class without a
    ``__slots__`` entry but without a ``__dict__`` either is fine: since
    Python 3.12, ``typing.Generic`` is such a class (implemented in C,
    it declares no ``__slots__`` and adds no ``__dict__``).
    """
    if not cls.__dictoffset__:
        return []
    culprits = [
        k.__name__
        for k in cls.__mro__
        if k.__dictoffset__
        and (
            "__slots__" not in k.__dict__
            or "__dict__" in _slot_names(k.__dict__["__slots__"])
        )
    ]
    return culprits or [cls.__name__]


def _slot_names(slots: object) -> tuple[str, ...]:
    """The names a ``__slots__`` value declares (a string is one name)."""
    if isinstance(slots, str):
        return (slots,)
    if isinstance(slots, Iterable):
        return tuple(str(name) for name in slots)
    return ()


_CHECKED: set[type] = set()


def check_tracker_class(cls: type) -> None:
    """Refuse a tracker class that would be slow or compare by value.

    Raises:
        TypeError: naming every reason and the fix (`define_tracker`).
    """
    if cls in _CHECKED:
        return
    reasons = slow_reasons(cls)
    if reasons:
        msg = (
            f"tracker class {cls.__qualname__} is not a fast tracker: "
            f"{'; '.join(reasons)}.  Declare it with "
            "@lifecycle.define_tracker."
        )
        raise TypeError(msg)
    _CHECKED.add(cls)


# Factories whose every call returns an equal, fresh value: a validator
# that accepts one of their values accepts them all.
_PLAIN_FACTORIES: frozenset[object] = frozenset(
    {list, dict, set, tuple, frozenset, bytearray}
)


def _attrs_init(cls: type) -> bool:
    """Whether `cls.__init__` is the one attrs generated (no user hooks)."""
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    return (
        code is not None
        and code.co_filename.startswith("<attrs generated")
        and not hasattr(cls, "__attrs_pre_init__")
        and not hasattr(cls, "__attrs_post_init__")
    )


def _key_check(
    cls: type, key: attrs.Attribute[Any], names: dict[str, object]
) -> list[str]:
    """The generated lines that validate the key ``req_id``."""
    if key.validator is None:
        return []
    names["check_key"] = key.validator
    names["key_field"] = key
    check = "    check_key(tracker, key_field, req_id)"
    key_type = getattr(cls, "key_type", None)
    if key.validator is not _check_req_id or not (
        key_type is None or issubclass(str, key_type)
    ):
        return [check]
    # The common key, inline: a str of an accepted length passes
    # `_check_req_id`; any other key goes through it.
    names["max_len"] = MAX_REQ_ID_LEN
    return [
        "    if type(req_id) is not str or not (",
        "        0 < len(req_id) <= max_len",
        "    ):",
        "    " + check,
    ]


def compiled_factory(cls: type) -> Callable[[Any], Any] | None:
    """A constructor of `cls` from its key alone, compiled once; or None.

    It does what the attrs ``__init__`` does for ``cls(req_id)``, except
    that the validators of the other fields ran once, here, on their
    defaults (a constant default, or a fresh value of a built-in
    container factory, is the same every time); the key's validator runs
    at every call.  None (use the class itself) when `cls` is not a fast
    tracker class, has its own ``__init__`` or attrs init hooks, a field
    without a default or with a converter, a factory that reads the
    instance or that is not a built-in container, or a default its
    validator refuses.
    """
    if slow_reasons(cls) or not _attrs_init(cls):
        return None
    fields = attrs.fields(cls)
    if not fields or fields[0].name != "req_id":
        return None
    proto: object = object.__new__(cls)
    names: dict[str, object] = {"new": object.__new__, "cls": cls}
    key = fields[0]
    lines = ["def make(req_id):", "    tracker = new(cls)"]
    lines += _key_check(cls, key, names)
    lines.append("    tracker.req_id = req_id")
    for i, field in enumerate(fields[1:]):
        default = field.default
        if field.converter is not None or default is attrs.NOTHING:
            return None
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            factory = default.factory
            if default.takes_self or factory not in _PLAIN_FACTORIES:
                return None
            value = factory()
            names[f"factory{i}"] = factory
            lines.append(f"    tracker.{field.name} = factory{i}()")
        else:
            value = default
            names[f"default{i}"] = default
            lines.append(f"    tracker.{field.name} = default{i}")
        if field.validator is not None:
            try:
                field.validator(proto, field, value)
            except Exception:  # noqa: BLE001 - the class itself will raise
                return None
    lines.append("    return tracker")
    exec("\n".join(lines), names)  # noqa: S102 - generated from attrs fields
    make: Callable[[Any], Any] = names["make"]  # type: ignore[assignment]
    return make
