"""KeyScheme: pure, injective, namespace-safe store keys."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.errors import KeySchemeError
from connector.store.keys import (
    KEY_VERSION,
    MAX_COMPONENT,
    SEPARATOR,
    KeyLayout,
    KeyScheme,
)

LAYOUT = KeyLayout("bfloat16", 16, 2 * 1024 * 1024, "L32")
HASH = bytes(range(32))


def scheme(**overrides) -> KeyScheme:
    fields = {
        "namespace": "prod",
        "model": "meta-llama/Llama-3.1-8B",
        "tp_rank": 0,
        "tp_size": 1,
        "layout": LAYOUT,
    }
    fields.update(overrides)
    return KeyScheme(**fields)


class TestKey:
    def test_exact_format(self):
        """The documented format, with the model escaped."""
        key = scheme(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, kv_group=3)
        assert (
            "kvl2@prod@meta-llama%2FLlama-3.1-8B@r@w@tp1of2@pp1of2@g3"
            "@bfloat16.16t.2097152b.L32@b" + HASH.hex()
        ) == key.key(HASH)
        named = scheme(model="m", revision="v1.2", generation="step 7")
        assert named.key(7) == (
            "kvl2@prod@m@rv1.2@wstep%207@tp0of1@pp0of1@g0"
            "@bfloat16.16t.2097152b.L32@i7"
        )

    def test_version_bumped(self):
        """Keys of the basename-only scheme (kvl1) can never be read."""
        assert KEY_VERSION == "kvl2"
        assert scheme().key(HASH).startswith("kvl2@")

    def test_pure_function(self):
        """Equal inputs give equal keys, across scheme instances."""
        assert scheme().key(HASH) == scheme().key(HASH)
        assert scheme() == scheme()

    def test_keys_is_key_per_hash(self):
        s = scheme()
        hashes = [HASH, b"\x01", 7, -3]
        assert [s.key(h) for h in hashes] == s.keys(hashes)

    def test_int_and_bytes_hashes_do_not_collide(self):
        """``0x01`` as int and ``b'\\x01'`` are different keys."""
        s = scheme()
        assert s.key(1) != s.key(b"\x01")
        assert s.key(1).endswith("@i1")
        assert s.key(-1).endswith("@i-1")

    @pytest.mark.parametrize(
        "change",
        [
            {"namespace": "staging"},
            {"namespace": ""},
            {"model": "meta-llama/Llama-3.1-70B"},
            {"model": "other-org/Llama-3.1-8B"},
            {"model": "Llama-3.1-8B"},
            {"revision": "main"},
            {"generation": "1"},
            {"tp_size": 2},
            {"tp_size": 2, "tp_rank": 1},
            {"pp_size": 2},
            {"kv_group": 1},
            {"layout": KeyLayout("float16", 16, 2 * 1024 * 1024, "L32")},
            {"layout": KeyLayout("bfloat16", 32, 2 * 1024 * 1024, "L32")},
            {"layout": KeyLayout("bfloat16", 16, 1024 * 1024, "L32")},
            {"layout": KeyLayout("bfloat16", 16, 2 * 1024 * 1024, "L16")},
        ],
    )
    def test_every_component_separates(self, change):
        """Changing any component changes the key of the same hash."""
        assert scheme().key(HASH) != scheme(**change).key(HASH)

    def test_replicated_ranks_share_keys(self):
        """TP ranks holding identical KV (kv_replicas) share keys."""
        keys = {
            scheme(tp_rank=r, tp_size=4, kv_replicas=2).key(HASH)
            for r in range(4)
        }
        assert len(keys) == 2
        assert scheme(tp_rank=1, tp_size=4, kv_replicas=2).kv_shard == 0
        mla = {
            scheme(tp_rank=r, tp_size=8, kv_replicas=8).key(HASH)
            for r in range(8)
        }
        assert len(mla) == 1

    def test_shard_count_in_key(self):
        """Rank 0 of TP=1 and rank 0 of TP=2 hold different bytes."""
        assert scheme(tp_size=1).key(HASH) != scheme(tp_size=2).key(HASH)

    def test_separator_in_names_cannot_forge(self):
        """A model or namespace containing '@' cannot mimic another."""
        forged = scheme(namespace="a@b", model="c")
        honest = scheme(namespace="a", model="b@c")
        assert forged.key(HASH) != honest.key(HASH)
        for s in (forged, honest):
            assert len(s.key(HASH).split(SEPARATOR)) == 10
        sneaky = scheme(model="m@tp0of1@pp0of1@g0@x")
        assert len(sneaky.key(HASH).split(SEPARATOR)) == 10
        moved = scheme(model="m", revision="@wx")
        assert moved.key(HASH) != scheme(model="m@r", generation="x").key(HASH)

    def test_long_components_are_bounded(self):
        """A long model path, revision or generation keeps keys short."""
        long = "/mnt/models/" + "very-long-directory-name/" * 40 + "llama"
        key = scheme(model=long, revision="r" * 300, generation="g" * 300)
        fields = key.key(HASH).split(SEPARATOR)
        assert len(fields) == 10
        assert all(len(f) <= MAX_COMPONENT + 2 for f in fields[2:5])
        assert len(key.key(HASH)) < 400
        other = scheme(model=long[:-1] + "b", revision="r" * 300)
        assert key.key(HASH) != other.key(HASH)
        assert key.key(HASH) == scheme(
            model=long, revision="r" * 300, generation="g" * 300
        ).key(HASH)

    def test_bounded_never_meets_kept_component(self):
        """A hashed component never equals one kept as is."""
        kept = "a" * MAX_COMPONENT
        hashed = "a" * (MAX_COMPONENT + 1)
        kept_key, hashed_key = scheme(model=kept), scheme(model=hashed)
        assert kept_key.key(HASH) != hashed_key.key(HASH)
        assert kept in kept_key.prefix
        assert "~" in hashed_key.prefix.split(SEPARATOR)[2]

    def test_prefix_is_per_scheme(self):
        s = scheme()
        assert not s.key(HASH).startswith(scheme(namespace="x").prefix)
        assert s.key(HASH).startswith(s.prefix)

    def test_no_request_id_field(self):
        """Keys depend on nothing request-specific."""
        assert "req" not in {f.name for f in attrs.fields(KeyScheme)}


class TestValidation:
    @pytest.mark.parametrize(
        ("change", "component"),
        [
            ({"tp_rank": -1}, "tp_rank"),
            ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
            ({"tp_size": 0}, "tp_size"),
            ({"pp_rank": 1}, "pp_rank"),
            ({"kv_group": -1}, "kv_group"),
            ({"kv_replicas": 3, "tp_size": 4}, "kv_replicas"),
            ({"model": ""}, "model"),
            ({"model": 3}, "model"),
            ({"tp_rank": True}, "tp_rank"),
            ({"revision": None}, "revision"),
            ({"generation": 1}, "generation"),
        ],
    )
    def test_bad_component(self, change, component):
        """Bad ranks and names raise KeySchemeError naming the field."""
        with pytest.raises(KeySchemeError) as info:
            scheme(**change)
        assert component == info.value.component

    @pytest.mark.parametrize("bad", [b"", "abc", 1.5, None, True])
    def test_bad_hash(self, bad):
        with pytest.raises(KeySchemeError) as info:
            scheme().key(bad)
        assert info.value.component == "block_hash"

    @pytest.mark.parametrize(
        ("fields", "component"),
        [
            ({"dtype": "Bad Type"}, "dtype"),
            ({"block_tokens": 0}, "block_tokens"),
            ({"block_bytes": -1}, "block_bytes"),
        ],
    )
    def test_bad_layout(self, fields, component):
        base = {"dtype": "uint8", "block_tokens": 16, "block_bytes": 1}
        with pytest.raises(KeySchemeError) as info:
            KeyLayout(**{**base, **fields})
        assert component == info.value.component


text = st.text(max_size=12)
long_text = st.text(max_size=80)


@given(
    a=st.tuples(text, text, st.binary(min_size=1, max_size=8)),
    b=st.tuples(text, text, st.binary(min_size=1, max_size=8)),
)
def test_injective(a, b):
    """Different (namespace, model, hash) never give the same key."""
    ns_a, model_a, hash_a = a
    ns_b, model_b, hash_b = b
    if not model_a or not model_b:
        return
    key_a = scheme(namespace=ns_a, model=model_a).key(hash_a)
    key_b = scheme(namespace=ns_b, model=model_b).key(hash_b)
    assert (key_a == key_b) == (a == b)


@given(
    a=st.tuples(long_text, long_text, long_text),
    b=st.tuples(long_text, long_text, long_text),
)
def test_identity_injective(a, b):
    """Different (model, revision, generation) never give the same key."""
    if not a[0] or not b[0]:
        return
    key_a = scheme(model=a[0], revision=a[1], generation=a[2]).key(HASH)
    key_b = scheme(model=b[0], revision=b[1], generation=b[2]).key(HASH)
    assert (key_a == key_b) == (a == b)
