"""`harness.scheduler.Harness` over a hybrid KV cache (vLLM's HMA).

`HybridHarness` drives vLLM 0.33's real Scheduler with several KV cache
groups, as vLLM plans them for a model that interleaves kinds of layers:
full attention and sliding-window attention (gpt-oss, Gemma 2/3), full
attention and recurrent state (Jamba, Nemotron-H, Granite 4.0-H,
Qwen3-Next), or all three.  By default group 0 holds the full-attention
layers and group 1 the sliding-window ones (`kinds` picks others); one
block pool serves every group, and every KV tensor is shared by one layer
of each group (vLLM's `KVCacheTensor(layers=[full_i, swa_i])`), so a
block id means the same memory in every group and only the group owning
the block writes it.  With more than one group vLLM's scheduler uses its
`HybridKVCacheCoordinator` and calls `request_finished_all_groups`.

The groups hold different numbers of blocks per request: vLLM gives a
sliding-window position that left the window the null block (id 0) and
frees its block.

A recurrent-state group (``MambaSpec`` in ``mamba_cache_mode="align"``,
its page the size of an attention page: a conv and an SSM state tensor
over the shared memory, as vLLM hands a Mamba layer its state) is played
as vLLM's runner plays it in align mode: a step that computes
``[start, stop)`` reads the state after ``start`` tokens from the block
the request last wrote (a new or resumed request: block
``(start - 1) // block_size``, where a prefix hit leaves it) and writes
the state after ``stop`` tokens to block ``ceil(stop / block_size) - 1``.
A state is a pure function of the prefix (`state_values`), so the runner
fails a step that starts from a missing or wrong state: a hit whose
state nobody restored, or a state stored for another prefix length.

How HMA is enabled on a CPU: `VllmConfig` turns the hybrid KV cache
manager off for a platform without HMA support (`disable_hybrid_kv_cache
_manager = True`; asking for it explicitly raises).  That flag only
steers `kv_cache_planning` (which would merge the groups into one); the
scheduler itself takes whatever `KVCacheConfig` it is given.  The
harness therefore builds the two-group `KVCacheConfig` itself and sets
the flag back to False after `VllmConfig` was built, so every part that
reads it sees HMA on.

Checks, after every step, for every group: each non-null block covering a
request's computed tokens holds exactly the KV recomputation would write
for that group's layers (whether computed, hit locally or loaded), every
sliding-window position inside the window of the next token is backed
by a real block, every recurrent group holds the state after the
request's computed tokens in the block the next step reads and the state
after ``(i + 1) * block_size`` tokens in every other real block ``i``,
and every block a request holds is referenced.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final, Literal

from harness.scheduler import (
    _MAX_FAILURES_PER_CHECK,
    Harness,
    _WorkerRequest,
    kv_values,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

NULL_BLOCK = 0
FULL, SLIDING = 0, 1  # the default layout's groups

GroupKind = Literal["full", "sliding", "mamba"]
KINDS: Final = ("full", "sliding", "mamba")
_MIN_GROUPS: Final = 2  # a hybrid model


def state_values(prefix_hash: int, layer: int, numel: int) -> torch.Tensor:
    """The recurrent state of `layer` after the prefix with this hash.

    `numel` floats, every one a nonzero integer below 2**16 (exact in
    float32, never the zeros of an unwritten block).
    """
    width = 8
    rows = -(-numel // width)
    keys = [(prefix_hash * 131 + r) % (1 << 61) for r in range(rows)]
    return kv_values(keys, layer + 1009, width).reshape(-1)[:numel]


@dataclasses.dataclass
class _HybridRequest(_WorkerRequest):
    """The runner's tables of one request: `tables[0] is block_ids`."""

    tables: list[list[int]] = dataclasses.field(default_factory=list)


def _same_tables(
    runner: Sequence[Sequence[int]], scheduler: Sequence[Sequence[int]]
) -> bool:
    """Equal, except where the scheduler holds the null block."""
    return len(runner) == len(scheduler) and all(
        len(r) == len(s)
        and all(b in (a, NULL_BLOCK) for a, b in zip(r, s, strict=True))
        for r, s in zip(runner, scheduler, strict=True)
    )


class HybridHarness(Harness):
    """`Harness` with several KV cache groups (full attention first).

    Args:
        connector: As for `Harness`.
        sliding_window: Tokens the sliding-window layers attend to.
        num_layers: Layers per group (each group has this many).
        kinds: Each group's kind, in group order: ``"full"``,
            ``"sliding"`` or ``"mamba"`` (recurrent state, align mode).
        **kwargs: As for `Harness`.
    """

    def __init__(
        self,
        connector: str,
        *,
        sliding_window: int = 40,
        num_layers: int = 2,
        kinds: Sequence[GroupKind] = ("full", "sliding"),
        **kwargs: Any,
    ) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or len(kinds) < _MIN_GROUPS:
            msg = f"kinds must be two or more of {KINDS}, not {kinds!r}"
            raise ValueError(msg)
        self.kinds: tuple[GroupKind, ...] = tuple(kinds)
        self.sliding_window = sliding_window
        self.layers_per_group = num_layers
        # The runner's state block per request (vLLM's `mamba_state_idx`).
        self._state_idx: dict[str, int] = {}
        self._state_tensors: dict[str, torch.Tensor] = {}
        super().__init__(
            connector, num_layers=len(self.kinds) * num_layers, **kwargs
        )

    # ---------------------------------------------------------- set-up

    @property
    def group_layers(self) -> list[list[str]]:
        """Layer names of each group, in group order."""
        n = self.layers_per_group
        return [
            self.layer_names[g * n : (g + 1) * n]
            for g in range(len(self.kinds))
        ]

    def _group_of(self, layer: int) -> int:
        return layer // self.layers_per_group

    @property
    def _state_numel(self) -> int:
        """Floats of one layer's state: one attention page."""
        return self.block_size * self.kv_width

    def _make_vllm_config(self, *args: Any, **kwargs: Any) -> VllmConfig:
        config = super()._make_vllm_config(*args, **kwargs)
        # See the module docstring: HMA is on for the scheduler.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        if "mamba" in self.kinds:
            # What vLLM sets for a hybrid recurrent model with prefix
            # caching on: states kept at block-aligned checkpoints.
            config.cache_config.mamba_cache_mode = "align"
        return config

    def _make_kv_cache_config(self) -> KVCacheConfig:
        import torch  # noqa: PLC0415
        from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MambaSpec,
            SlidingWindowSpec,
        )

        heads, width = 1, self.kv_width // 2
        shape = {
            "block_size": self.block_size,
            "num_kv_heads": heads,
            "head_size": width,
            "dtype": torch.float32,
        }
        conv = self._conv_numel
        specs = {
            "full": FullAttentionSpec(**shape),  # type: ignore[arg-type]
            "sliding": SlidingWindowSpec(
                **shape,  # type: ignore[arg-type]
                sliding_window=self.sliding_window,
            ),
            "mamba": MambaSpec(
                block_size=self.block_size,
                shapes=((conv,), (self._state_numel - conv,)),
                dtypes=(torch.float32, torch.float32),
                mamba_cache_mode="align",
            ),
        }
        page = specs["full"].page_size_bytes
        assert specs["mamba"].page_size_bytes == page
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * self.num_blocks,
                    layers=list(shared),
                    layer_stride=page * self.num_blocks,
                    block_stride=page,
                )
                for shared in zip(*self.group_layers, strict=True)
            ],
            kv_cache_groups=[
                KVCacheGroupSpec(layers, specs[kind])
                for layers, kind in zip(
                    self.group_layers, self.kinds, strict=True
                )
            ],
        )

    @property
    def _conv_numel(self) -> int:
        """Floats of a state's first (conv) tensor; the rest is SSM."""
        return 2 * self.kv_width

    def _make_kv_caches(self) -> dict[str, Any]:
        """One tensor per `KVCacheTensor`, shared by the layers it lists.

        One layer of each group shares one.  A recurrent layer gets what
        vLLM gives it: a list of blocks-first state tensors (conv, SSM),
        views over the shared memory.
        """
        import torch  # noqa: PLC0415

        caches: dict[str, Any] = {}
        conv = self._conv_numel
        for tensor in self.kv_cache_config.kv_cache_tensors:
            shared = torch.zeros(
                self.num_blocks,
                self.block_size,
                self.kv_width,
                dtype=torch.float32,
            )
            for name in tensor.layers:
                if self.kinds[
                    self._group_of(self.layer_names.index(name))
                ] != ("mamba"):
                    caches[name] = shared
                    continue
                flat = shared.view(self.num_blocks, -1)
                self._state_tensors[name] = flat
                caches[name] = [flat[:, :conv], flat[:, conv:]]
        return {n: caches[n] for n in self.layer_names}

    # ---------------------------------------------------- the worker

    def _tables(self, req_id: str) -> list[list[int]]:
        request = self._worker_reqs[req_id]
        if isinstance(request, _HybridRequest):
            return request.tables
        return [request.block_ids]

    def _set_tables(
        self, req_id: str, tables: Sequence[Sequence[int]]
    ) -> None:
        copies = [list(t) for t in tables] or [[]]
        copies += [[] for _ in range(len(self.kinds) - len(copies))]
        self._worker_reqs[req_id] = _HybridRequest(copies[0], copies)

    def _apply_new_requests(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, int]:
        starts = super()._apply_new_requests(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self._set_tables(new.req_id, new.block_ids)
        return starts

    def _apply_cached_requests(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, int]:
        """As the base runner, for every group's table."""
        cached = scheduler_output.scheduled_cached_reqs
        tables = {
            r: self._tables(r)
            for r in cached.req_ids
            if r in self._worker_reqs and r not in cached.resumed_req_ids
        }
        starts = super()._apply_cached_requests(scheduler_output)
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id not in tables:  # resumed or unknown: replaced
                self._set_tables(req_id, new_ids or ())
                continue
            # group 0 (the same list as `block_ids`) was extended above
            for table, ids in zip(
                tables[req_id][1:], (new_ids or ())[1:], strict=False
            ):
                table.extend(ids)
        return starts

    def _update_worker_states(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, range]:
        """The base runner's update, checking every group's table."""
        # vLLM's runner forgets the state block of finished, preempted and
        # resumed requests (`cleanup_mamba_state_idx`); a new request (a
        # resumed one under v2) starts from its computed tokens.
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in (
            *scheduler_output.finished_req_ids,
            *(scheduler_output.preempted_req_ids or ()),
            *cached.resumed_req_ids,
            *(new.req_id for new in scheduler_output.scheduled_new_reqs),
        ):
            self._state_idx.pop(req_id, None)
        positions = super()._update_worker_states(scheduler_output)
        manager = self.scheduler.kv_cache_manager
        for req_id in positions:
            expected = [list(t) for t in manager.get_block_ids(req_id)]
            # vLLM nulls a sliding-window block that left the window in its
            # own table only; the runner keeps the stale id (never read).
            if not _same_tables(self._tables(req_id), expected):
                self._fail(
                    f"{req_id}: runner block tables {self._tables(req_id)} "
                    f"differ from the scheduler's {expected}"
                )
                self._set_tables(req_id, expected)
        return positions

    def _group_slots(
        self, req_id: str, positions: range, group: int
    ) -> torch.Tensor:
        import torch  # noqa: PLC0415

        table = self._tables(req_id)[group]
        bs = self.block_size
        slots = []
        for p in positions:
            block = table[p // bs]
            if block == NULL_BLOCK:
                self._fail(f"{req_id}: computes position {p} in block 0")
            slots.append(block * bs + p % bs)
        return torch.tensor(slots, dtype=torch.int64)

    def _slots(self, req_id: str, positions: range) -> torch.Tensor:
        return self._group_slots(req_id, positions, FULL)

    def _state_blocks(
        self, positions: dict[str, range]
    ) -> dict[str, tuple[int, int]]:
        """Per scheduled request, the state block it reads and writes.

        vLLM's `preprocess_mamba`: the block the request wrote last (a new
        request: ``(start - 1) // block_size``, -1 from scratch) and
        ``ceil(stop / block_size) - 1``.
        """
        bs = self.block_size
        moves = {}
        for req_id, ps in positions.items():
            if not ps:
                continue
            prev = self._state_idx.get(req_id, (ps.start - 1) // bs)
            moves[req_id] = (prev, -(-ps.stop // bs) - 1)
            self._state_idx[req_id] = moves[req_id][1]
        return moves

    def _forward_state(
        self,
        layer: int,
        name: str,
        positions: dict[str, range],
        moves: dict[str, tuple[int, int]],
    ) -> None:
        """Run a recurrent layer: check the state read, write the new one."""
        group = self._group_of(layer)
        state = self._state_tensors[name]
        numel = self._state_numel
        for req_id, (prev, curr) in moves.items():
            ps = positions[req_id]
            table = self._tables(req_id)[group]
            hashes = self._hashes[req_id]
            if ps.stop > len(hashes):
                self._fail(f"{req_id}: position {ps.stop - 1} unknown")
                continue
            if ps.start > 0:
                block = table[prev] if 0 <= prev < len(table) else NULL_BLOCK
                expected = state_values(hashes[ps.start - 1], layer, numel)
                if block == NULL_BLOCK:
                    self._fail(
                        f"step {self.num_steps}: {req_id} resumes at "
                        f"{ps.start} tokens with no state block in group "
                        f"{group} (index {prev})"
                    )
                elif not bool((state[block] == expected).all()):
                    self._fail(
                        f"step {self.num_steps}: {req_id} resumes at "
                        f"{ps.start} tokens from a wrong state in group "
                        f"{group} {name} (index {prev}, block {block})"
                    )
            block = table[curr] if curr < len(table) else NULL_BLOCK
            if block == NULL_BLOCK:
                self._fail(
                    f"step {self.num_steps}: {req_id} writes its state at "
                    f"{ps.stop} tokens into no block (group {group}, "
                    f"index {curr})"
                )
                continue
            state[block] = state_values(hashes[ps.stop - 1], layer, numel)

    def _forward(
        self, positions: dict[str, range], attn_metadata: Any
    ) -> None:
        connector = self.worker_connector
        moves = self._state_blocks(positions) if "mamba" in self.kinds else {}
        for layer, name in enumerate(self.layer_names):
            group = self._group_of(layer)
            connector.wait_for_layer_load(name)
            if self.kinds[group] == "mamba":
                self._forward_state(layer, name, positions, moves)
                connector.save_kv_layer(
                    name, self.kv_caches[name], attn_metadata
                )
                continue
            kv = self.kv_caches[name].view(-1, self.kv_width)
            for req_id, ps in positions.items():
                if not ps:
                    continue
                hashes = self._hashes[req_id]
                if ps.stop > len(hashes):
                    self._fail(f"{req_id}: position {ps.stop - 1} unknown")
                    continue
                kv[self._group_slots(req_id, ps, group)] = kv_values(
                    hashes[ps.start : ps.stop], layer, self.kv_width
                )
            connector.save_kv_layer(name, self.kv_caches[name], attn_metadata)

    # ---------------------------------------------------------- checks

    def _check_contents(self) -> None:
        """Every group's real blocks over computed tokens hold their KV."""
        manager = self.scheduler.kv_cache_manager
        self._reported = 0
        for req_id, request in self._computed_requests():
            computed = request.num_computed_tokens
            if len(self._hashes[req_id]) < computed:
                self._fail(f"{req_id}: {computed} computed tokens unknown")
                continue
            for group, table in enumerate(manager.get_block_ids(req_id)):
                if self.kinds[group] == "mamba":
                    self._check_state_group(request, group, table)
                else:
                    self._check_group(request, group, table)

    def _check_state_group(
        self, request: Request, group: int, table: Sequence[int]
    ) -> None:
        """One recurrent group's real blocks of one request.

        The block the next step reads holds the state after the computed
        tokens; every other real block ``i`` the state after
        ``(i + 1) * block_size`` tokens (a checkpoint).
        """
        req_id, computed = request.request_id, request.num_computed_tokens
        bs = self.block_size
        current = -(-computed // bs) - 1
        if current >= len(table) or table[current] == NULL_BLOCK:
            self._fail(
                f"step {self.num_steps}: {req_id} ({computed} computed) has "
                f"no state block in group {group} (index {current})"
            )
            return
        hashes = self._hashes[req_id]
        numel = self._state_numel
        for index, block in enumerate(table[: current + 1]):
            if block == NULL_BLOCK:
                continue
            tokens = computed if index == current else (index + 1) * bs
            for layer, name in enumerate(self.layer_names):
                if self._group_of(layer) != group:
                    continue
                expected = state_values(hashes[tokens - 1], layer, numel)
                actual = self._state_tensors[name][block]
                if (
                    not bool((actual == expected).all())
                    and self._reported < _MAX_FAILURES_PER_CHECK
                ):
                    self._reported += 1
                    self._fail(
                        f"step {self.num_steps}: {req_id} "
                        f"({request.status.name}, {computed} computed) holds "
                        f"a wrong state in group {group} {name} at index "
                        f"{index} (block {block}), for {tokens} tokens"
                    )

    def _check_group(
        self, request: Request, group: int, table: Sequence[int]
    ) -> None:
        """One group's blocks of one request (see `_check_contents`)."""
        req_id, computed = request.request_id, request.num_computed_tokens
        bs = self.block_size
        if len(table) * bs < computed:
            self._fail(
                f"{req_id}: {computed} computed tokens but group {group} "
                f"has only {len(table)} blocks"
            )
            return
        real = [p for p in range(computed) if table[p // bs] != NULL_BLOCK]
        window = range(max(computed - self.sliding_window + 1, 0), computed)
        sliding = self.kinds[group] == "sliding"
        needed = window if sliding else range(computed)
        missing = [p for p in needed if table[p // bs] == NULL_BLOCK]
        if missing:
            self._fail(
                f"step {self.num_steps}: {req_id} position {missing[0]} "
                f"has no block in group {group}"
            )
        hashes = self._hashes[req_id]
        for layer, name in enumerate(self.layer_names):
            if self._group_of(layer) != group or not real:
                continue
            kv = self.kv_caches[name].view(-1, self.kv_width)
            slots = [table[p // bs] * bs + p % bs for p in real]
            actual = kv[self._table_tensor(slots)]
            expected = kv_values(
                [hashes[p] for p in real], layer, self.kv_width
            )
            bad = (actual != expected).any(dim=1).nonzero()
            if bad.numel() and self._reported < _MAX_FAILURES_PER_CHECK:
                self._reported += 1
                p = real[int(bad[0])]
                self._fail(
                    f"step {self.num_steps}: {req_id} "
                    f"({request.status.name}, {computed} computed) holds "
                    f"wrong KV in group {group} {name} at {bad.numel()} "
                    f"position(s), first {p} (block {table[p // bs]})"
                )

    def _check_block_pool(self) -> None:
        """Reference counts hold; every group's held blocks are in use."""
        pool = self.scheduler.kv_cache_manager.block_pool
        blocks = [b for b in pool.blocks if not b.is_null]
        negative = [b.block_id for b in blocks if b.ref_cnt < 0]
        if negative:
            self._fail(f"step {self.num_steps}: ref_cnt < 0: {negative}")
        unreferenced = sum(1 for b in blocks if b.ref_cnt == 0)
        if unreferenced != pool.get_num_free_blocks():
            self._fail(
                f"step {self.num_steps}: {pool.get_num_free_blocks()} blocks "
                f"in the free queue but {unreferenced} with ref_cnt 0"
            )
        manager = self.scheduler.kv_cache_manager
        for req_id in self.scheduler.requests:
            for group, table in enumerate(manager.get_block_ids(req_id)):
                for block_id in table:
                    block = pool.blocks[block_id]
                    if not block.is_null and block.ref_cnt <= 0:
                        self._fail(
                            f"step {self.num_steps}: {req_id} holds block "
                            f"{block_id} of group {group}, which is free"
                        )
