"""Store keys: a pure function of where a KV block belongs and what it is.

A key is::

    kvl2@<namespace>@<model>@r<revision>@w<weights generation>
        @tp<shard>of<shards>@pp<rank>of<size>
        @g<kv group>@<layout fingerprint>@<b|i><block hash hex>

Rules:

- No request id: two requests (or two vLLM instances) with the same prefix
  and the same parallel layout produce the same keys, so a put of an
  already-stored prefix is deduplicated by one ``batch_is_exist``.
- Every free-text component (namespace, model, revision, weights
  generation, layout detail) is percent-encoded so it never contains the
  ``@`` separator (nor ``%`` or ``/`` unescaped). The encoding is
  injective and the number of fields is fixed, hence a model named
  ``"a@b"`` cannot produce a key of another model or namespace: different
  inputs always give different keys.
- The model, revision and generation are bounded: an escaped component
  longer than `MAX_COMPONENT` characters is replaced by its first 32
  characters, ``~`` and 32 hex digits of its SHA-256 (65 characters,
  longer than any component kept as is, so the two forms never meet).
  A key stays short whatever path or name the model was given.
- The model is the full name or path as configured, never its last
  component, so ``org-a/llama`` and ``org-b/llama`` (or ``/models/v1/llama``
  and ``/models/v2/llama``) stay apart; the revision, when set, too.
- The weights generation separates KV computed with different weights
  of the same model (a weight update of an RL trainer): KV of an older
  generation never matches a key of a newer one.
- The TP component is the *KV shard*: ranks holding identical KV bytes
  (``kv_replicas`` of them, e.g. GQA with more ranks than KV heads, or MLA
  where every rank holds everything) share keys, exactly like vLLM's
  ``tp_rank // replication``. The shard *count* is in the key too, so
  TP=2 and TP=4 deployments (different head slices) never share a key.
- The layout fingerprint (dtype, tokens per block, bytes per block and a
  free-form detail such as the number of layers) keeps incompatible block
  layouts apart, so a load never reads bytes of a different shape.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

import attrs

from connector.errors import KeySchemeError

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "KEY_VERSION",
    "MAX_COMPONENT",
    "SEPARATOR",
    "BlockHash",
    "KeyLayout",
    "KeyScheme",
]

KEY_VERSION: Final = "kvl2"
SEPARATOR: Final = "@"
MAX_COMPONENT: Final = 64
"""Longest escaped model, revision or generation kept as is in a key."""
_HASHED_HEAD: Final = 32

BlockHash = bytes | int
"""vLLM's chained prefix block hash: ``bytes`` (0.2x+) or an ``int``."""

_DTYPE_RE: Final = re.compile(r"^[a-z][a-z0-9_]*$")


def escape(component: str) -> str:
    """Percent-encode everything except ``[A-Za-z0-9_.~-]``.

    Injective; the result never contains the ``@`` separator or ``/``.
    """
    return quote(component, safe="")


def bounded(component: str) -> str:
    """`escape` `component`, hashed when longer than `MAX_COMPONENT`.

    Injective up to SHA-256 collisions: a hashed form is longer than
    every component kept as is.
    """
    escaped = escape(component)
    if len(escaped) <= MAX_COMPONENT:
        return escaped
    digest = hashlib.sha256(escaped.encode()).hexdigest()[:32]
    return f"{escaped[:_HASHED_HEAD]}~{digest}"


def _non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeySchemeError(name, value, "expected an integer")
    if value < 0:
        raise KeySchemeError(name, value, "must not be negative")


def _check_int(_: object, field: attrs.Attribute[int], value: int) -> None:
    _non_negative(field.name, value)


def _check_pos(_: object, field: attrs.Attribute[int], value: int) -> None:
    _non_negative(field.name, value)
    if value == 0:
        raise KeySchemeError(field.name, value, "must be positive")


def _check_text(_: object, field: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise KeySchemeError(field.name, value, "expected a string")


def _check_dtype(_: object, field: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _DTYPE_RE.match(value):
        reason = "expected a dtype name such as 'bfloat16' or 'float8_e4m3fn'"
        raise KeySchemeError(field.name, value, reason)


@attrs.frozen
class KeyLayout:
    """What one stored KV block looks like, for the key fingerprint.

    Attributes:
        dtype: element type name, e.g. ``"bfloat16"`` (``torch.bfloat16``
            may be passed as ``str(dtype).removeprefix("torch.")``).
        block_tokens: tokens per block.
        block_bytes: bytes of one stored object (all layers of a block).
        detail: anything else that changes the bytes (layer count, head
            layout, "cross-layer" vs "per-layer"), free text.
    """

    dtype: str = attrs.field(validator=_check_dtype)
    block_tokens: int = attrs.field(validator=_check_pos)
    block_bytes: int = attrs.field(validator=_check_pos)
    detail: str = attrs.field(default="", validator=_check_text)

    @property
    def fingerprint(self) -> str:
        """``<dtype>.<tokens>t.<bytes>b[.<escaped detail>]``."""
        base = f"{self.dtype}.{self.block_tokens}t.{self.block_bytes}b"
        return f"{base}.{escape(self.detail)}" if self.detail else base


@attrs.frozen
class KeyScheme:
    """Maps chained block hashes to store keys for one rank's KV.

    Construct once per (rank, KV group); ``key``/``keys`` then cost one
    string concatenation and one ``hex()`` per hash.

    Attributes:
        namespace: cache prefix; ``""`` is a namespace of its own.
        model: model name or path, as configured (never shortened).
        tp_rank: this worker's tensor-parallel rank.
        tp_size: tensor-parallel world size.
        layout: block layout fingerprint.
        pp_rank: pipeline-parallel rank.
        pp_size: pipeline-parallel world size.
        kv_group: vLLM KV-cache group id.
        kv_replicas: how many consecutive TP ranks hold identical KV
            (1 = every rank distinct; ``tp_size`` for MLA); they share keys.
        revision: the model revision (``""``: none configured).
        generation: the weights generation (``""``: the configured
            weights, before any cache reset).

    Raises:
        KeySchemeError: on construction, naming the bad component.
    """

    namespace: str = attrs.field(validator=_check_text)
    model: str = attrs.field(validator=_check_text)
    tp_rank: int = attrs.field(validator=_check_int)
    tp_size: int = attrs.field(validator=_check_pos)
    layout: KeyLayout = attrs.field(
        validator=attrs.validators.instance_of(KeyLayout)
    )
    pp_rank: int = attrs.field(default=0, validator=_check_int)
    pp_size: int = attrs.field(default=1, validator=_check_pos)
    kv_group: int = attrs.field(default=0, validator=_check_int)
    kv_replicas: int = attrs.field(default=1, validator=_check_pos)
    revision: str = attrs.field(default="", validator=_check_text)
    generation: str = attrs.field(default="", validator=_check_text)
    _prefix: str = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.model:
            name, reason = "model", "must not be empty"
            raise KeySchemeError(name, self.model, reason)
        if self.tp_rank >= self.tp_size:
            reason = f"must be below tp_size={self.tp_size}"
            name = "tp_rank"
            raise KeySchemeError(name, self.tp_rank, reason)
        if self.pp_rank >= self.pp_size:
            reason = f"must be below pp_size={self.pp_size}"
            name = "pp_rank"
            raise KeySchemeError(name, self.pp_rank, reason)
        if self.tp_size % self.kv_replicas:
            reason = f"must divide tp_size={self.tp_size}"
            name = "kv_replicas"
            raise KeySchemeError(name, self.kv_replicas, reason)
        shard = self.tp_rank // self.kv_replicas
        shards = self.tp_size // self.kv_replicas
        prefix = SEPARATOR.join(
            (
                KEY_VERSION,
                escape(self.namespace),
                bounded(self.model),
                f"r{bounded(self.revision)}",
                f"w{bounded(self.generation)}",
                f"tp{shard}of{shards}",
                f"pp{self.pp_rank}of{self.pp_size}",
                f"g{self.kv_group}",
                self.layout.fingerprint,
                "",
            )
        )
        object.__setattr__(self, "_prefix", prefix)

    @property
    def prefix(self) -> str:
        """Everything before the hash, ending in the separator."""
        return self._prefix

    @property
    def kv_shard(self) -> int:
        """The TP shard whose KV this rank holds."""
        return self.tp_rank // self.kv_replicas

    def key(self, block_hash: BlockHash) -> str:
        """The key of one block.

        Raises:
            KeySchemeError: ``block_hash`` is empty or not bytes/int.
        """
        if isinstance(block_hash, bytes):
            if not block_hash:
                name, reason = "block_hash", "must not be empty"
                raise KeySchemeError(name, block_hash, reason)
            return f"{self._prefix}b{block_hash.hex()}"
        if isinstance(block_hash, int) and not isinstance(block_hash, bool):
            return f"{self._prefix}i{block_hash:x}"
        name, reason = "block_hash", "expected bytes or int"
        raise KeySchemeError(name, block_hash, reason)

    def keys(self, block_hashes: Iterable[BlockHash]) -> list[str]:
        """The keys of many blocks, in order."""
        key = self.key
        return [key(h) for h in block_hashes]
