"""The decode loop over the compact forward: slots, CUDA graphs of whole steps, compaction and refill.

``S`` slots each hold one row being sampled (its own KV cache row, length, token count). One *step* feeds every
slot's last token through :meth:`CompactDecoder.decode`, samples the next one and does the bookkeeping (end of
sequence, outputs, entropy, log-probability) on the GPU; there the whole step is a CUDA graph, one per slot count (and
attention-length bucket, for PyTorch attention), replayed ``check_every`` times before the host looks. Then:

- **refill**: rows still waiting take the slots of finished ones (their prompts prefilled into those cache
  rows), so ``S`` can be smaller than the number of rows and the KV cache is sized to ``S``, not to the batch;
- **compaction**: with nobody waiting and at most half the slots live, the live ones move to the front of a
  smaller workspace (the next power of two), whose steps cost less.

Prefills are CUDA graphs too where the prefill's kernels run (:meth:`CompactDecoder.prefill` is about eight
launches a layer, host-bound below some ten thousand tokens): one per power of two of rows and bucket of
positions (:func:`length_bucket`), the rows filled up with empty ones that write no cache entry; not with a memory
budget or without kept workspaces (see :meth:`SlotDecoder._graphs_prefill`).

A row's tokens depend only on its own prompt and draws: compaction and refill change which slot a row sits in, never
what it samples (greedy: bit for bit up to the matmul's batch-size dependence). The state it keeps between steps is
in :mod:`scgrpo.rollout.slot_state`.

With ``keep_states``, each emitted token's final hidden state (what the head read to draw it: the policy's state
before that token) is kept too, for the self-teacher's student side (:attr:`SlotDecoder.states`). The states of a
whole batch would take GPU memory the KV cache needs (an 8B model's 64 rows of 1,024 tokens: 0.5 GiB), so a step
writes them into a small staging buffer of up to :data:`STAGE_STEPS` steps, which the host empties into a host tensor
when the next burst of steps would not fit (through pinned buffers, while the next steps run), and at the end.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional, Sequence

import torch
from torch import Tensor

from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.compiled import Compiled
from scgrpo.rollout.graphs import warmup_stream
from scgrpo.rollout.memory import memory_free
from scgrpo.rollout.sampling import draw, sampling_distribution
from scgrpo.rollout.slot_state import (BUDGET_SHARE, LoopStats, Outputs, PrefillGraph, SlotState, Stage, length_bucket,
                                       slots_within)

log = logging.getLogger(__name__)

FREE_MEMORY_SHARE = 0.25
"""Share of the GPU's free memory the slots' KV cache takes without a budget (:func:`memory_free` is an upper
bound, and the update after the rollout needs room)."""
LOGIT_BYTES = 16
"""Bytes a slot's logits take per vocabulary entry, counted against a budget: fp32, a few copies."""
REFILL_DIVISOR = 4
"""Waiting rows are admitted once 1/REFILL_DIVISOR of the slots (or every waiting row) can be: a prefill is a
whole forward's launches, worth running for several rows at once."""
MIN_COMPACT_SLOTS = 8
"""Compaction leaves at least this many slots (and no workspace this small is compacted): a smaller step saves
little, and every slot count records its own CUDA graphs."""
PREFILL_TOKENS = 16384
"""Prompt tokens one prefill runs at most (its activations cover every prompt in it at once)."""
MAX_PREFILL_GRAPHS = 32
"""Prefill shapes a workspace records as CUDA graphs; past that, prefills run uncaptured."""
STAGE_STEPS = 64
"""Steps' states the staging buffer holds (``keep_states``), at most :data:`STAGE_BYTES` (and at least one burst's):
each emptying is a host round trip (an 8B model's 1,023 steps emptied every 8 steps: 0.34 s more sampling)."""
STAGE_BYTES = 64 << 20
"""Bytes the staging buffer's states take at most."""


def host_states(rows: int, columns: int, hidden: int, dtype: torch.dtype) -> Tensor:
    """The host tensor a rollout's kept states are scattered into: pageable and uninitialised, so that only the pages
    of the columns written are ever touched (the positions past a row's end stay undefined, and nothing reads them)."""
    return torch.empty(rows, columns, hidden, dtype=dtype)


class SlotDecoder:
    """Samples completions of many prompts with a :class:`CompactDecoder` (see the module docstring)."""

    def __init__(self, decoder: CompactDecoder, eos_ids: Sequence[int], pad_id: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 min_new_tokens: int = 0, cuda_graphs: bool = True, check_every: int = 8,
                 max_slots: int = 0, refill: bool = True, compaction: bool = True,
                 memory_budget: Optional[int] = None, keep_states: bool = False) -> None:
        self.decoder = decoder
        self.device = decoder.device
        self.pad_id, self.max_new = pad_id, max_new_tokens
        self.temperature, self.top_p, self.top_k, self.greedy = temperature, top_p, top_k, greedy
        self.min_new = min_new_tokens
        self.graphs = cuda_graphs and self.device.type == "cuda"
        self.check_every = check_every if self.device.type == "cuda" else 1
        self.max_slots, self.refill, self.compaction = max_slots, refill, compaction
        self.memory_budget = memory_budget
        vocab = decoder.embed.shape[0]
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.is_eos[self.eos[self.eos < vocab]] = True
        self.pool = None
        self.stats: dict[str, float] = {}
        # the softmax, entropy and draw over the vocabulary compiled (fused passes over the logits)
        self._draw = Compiled(self._draw_fn, "sampling") if decoder.compiled else self._draw_fn
        self.keep_workspace = True
        self._key = None  # (rows, cache length, decoder version) the kept workspaces were built for
        self._out: Optional[Outputs] = None
        self._states: dict[int, SlotState] = {}
        self._top: Optional[int] = None  # slots of the kept workspace's full-size state
        # prefills as CUDA graphs (with the prefill's kernels: about eight launches a layer, still host-bound)
        self.prefill_graphs = self.graphs
        self._prefills: dict[tuple, PrefillGraph] = {}
        self.keep_states = keep_states  # (its recorded steps write the stage)
        self.want_states = keep_states  # this call hands the states back (else the stage is emptied unread)
        self.states: Optional[Tensor] = None  # [N, C, H] the last call's final states (keep_states), on the host
        self._stage: Optional[Stage] = None
        self._staged = 0  # emissions in the stage (known to the host without a read)
        self._pending = 0  # emissions copied to the host's buffers, not yet in the host tensor
        self._copied: Optional["torch.cuda.Event"] = None  # the end of that copy (on a GPU)
        self._host: Optional[Tensor] = None  # [N, C, H] the states being gathered

    # ------------------------------------------------------------------------------------------ one step
    def _ban_eos(self, logits: Tensor, count: Tensor) -> Tensor:
        """No end-of-sequence for rows that have made fewer than ``min_new`` tokens."""
        if not (self.min_new and self.eos.numel()):
            return logits
        return logits.masked_fill((count < self.min_new).unsqueeze(1) & self.is_eos.unsqueeze(0), float("-inf"))

    def _draw_fn(self, logits: Tensor, uniform: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self._ban_eos(logits, count)
        probs, lse, entropy = sampling_distribution(logits, self.temperature)
        token, logprob = draw(logits, probs, lse, uniform, self.temperature, self.top_p, self.top_k)
        return token, logprob, entropy

    def _sample(self, logits: Tensor, uniform: Optional[Tensor], count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if uniform is None:  # greedy
            zero = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
            return self._ban_eos(logits, count).argmax(dim=-1), zero, zero
        return self._draw(logits, uniform, count)

    def _emit(self, state: SlotState, out: Outputs, logits: Tensor, slots: Optional[Tensor],
              hidden: Optional[Tensor] = None) -> None:
        """Samples a token for ``slots`` (None: all) from their ``logits`` and books it (and, with ``keep_states``,
        the ``hidden`` states the logits came from)."""
        idx = slice(None) if slots is None else slots
        live, count, row = state.live[idx], state.count[idx], state.row[idx]
        uniform = None if self.greedy else torch.rand(logits.shape[0], 1, device=logits.device)
        token, logprob, entropy = self._sample(logits, uniform, count)
        token = torch.where(live, token, torch.full_like(token, self.pad_id))
        at = count.clamp(max=self.max_new - 1)
        if self._stage is not None:
            stage = self._stage
            columns = torch.arange(state.slots, device=logits.device) if slots is None else slots
            stage.hidden[stage.k, columns] = hidden
            stage.row[stage.k, columns] = torch.where(live, row, torch.full_like(row, out.tokens.shape[0] - 1))
            stage.at[stage.k, columns] = at
            stage.k += 1
        out.tokens[row, at] = torch.where(live, token, out.tokens[row, at])
        out.logprobs[row, at] = torch.where(live, logprob, out.logprobs[row, at])
        out.entropy.index_add_(0, row, torch.where(live, entropy, torch.zeros_like(entropy)))
        ended = live & (self.is_eos[token] | (count + 1 >= self.max_new))
        state.count[idx] = count + live.long()
        out.count[row] = count + live.long()
        state.live[idx] = live & ~ended
        state.tokens[idx] = token

    def _step(self, state: SlotState, out: Outputs, length: int) -> None:
        hidden = None
        if self._stage is not None:
            logits, hidden = self.decoder.decode(state.tokens, state.lens, state.cache, length, states=True)
        else:
            logits = self.decoder.decode(state.tokens, state.lens, state.cache, length)
        limit = state.cache.shape[4] - 1
        state.lens.copy_((state.lens + 1).clamp(max=limit))  # free slots keep writing into their last entry
        self._emit(state, out, logits, None, hidden)

    def _run(self, state: SlotState, out: Outputs, length: int, steps: int) -> None:
        if not self.graphs:
            for _ in range(steps):
                self._step(state, out, length)
            return
        graph = state.graphs.get(length)
        if graph is None:
            graph = state.graphs[length] = self._record(state, out, length)
        for _ in range(steps):
            graph.replay()

    def _record(self, state: SlotState, out: Outputs, length: int):
        """Records one step as a CUDA graph (after a warm-up step on a side stream, which also compiles). The
        warm-up's effects are undone: every buffer the step writes is restored."""
        saved = [t.clone() for t in self._written(state, out)]
        rng = torch.cuda.get_rng_state(self.device)  # recording draws nothing: a seed gives the same tokens either way
        stream = warmup_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(state, out, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self._restore(state, out, saved)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(state, out, length)
        self._restore(state, out, saved)
        torch.cuda.set_rng_state(rng, self.device)
        self.stats["rollout/graphs_recorded"] = self.stats.get("rollout/graphs_recorded", 0.0) + 1
        return graph

    def _written(self, state: SlotState, out: Outputs) -> list[Tensor]:
        """The buffers a step writes."""
        written = [state.tokens, state.lens, state.live, state.count, out.tokens, out.logprobs, out.entropy, out.count]
        if self._stage is not None:
            written += [self._stage.row, self._stage.at, self._stage.k]
        return written

    def _restore(self, state: SlotState, out: Outputs, saved: list[Tensor]) -> None:
        for dst, src in zip(self._written(state, out), saved):
            dst.copy_(src)

    # ------------------------------------------------------------------------------------------ workspace
    def _workspace(self, rows: int, cache_len: int) -> tuple[Outputs, int]:
        """Output buffers for ``rows`` rows, reset; the kept slot workspaces stay valid (their graphs write into
        these buffers and read the decoder's weights) while the row count, the cache length (grow-only) and the
        decoder's tensors stay the same."""
        self.decoder.rope_tables(cache_len)
        kept = self._key
        if kept is not None and kept[0] >= rows and kept[1] >= cache_len and kept[2] == self.decoder.version:
            cache_len = kept[1]
        else:
            self.release()
            device = self.device
            self._out = Outputs(
                tokens=torch.empty((rows + 1, self.max_new), dtype=torch.long, device=device),
                logprobs=torch.empty(rows + 1, self.max_new, dtype=torch.float32, device=device),
                entropy=torch.empty(rows + 1, dtype=torch.float32, device=device),
                count=torch.empty(rows + 1, dtype=torch.long, device=device),
            )
            self._key = (rows, cache_len, self.decoder.version)
        out = self._out
        out.tokens.fill_(self.pad_id)
        out.logprobs.zero_()
        out.entropy.zero_()
        out.count.zero_()
        return out, cache_len

    def _state(self, slots: int, cache_len: int, scratch: int, within: Optional[SlotState] = None) -> SlotState:
        """The workspace of ``slots`` slots, emptied (its cache keeps stale entries: nothing reads past a row's
        length). ``within``: a bigger workspace whose cache's first slots this one's cache is (compaction moves
        rows down inside one allocation: no second cache, and a graph of either size keeps fixed addresses)."""
        state = self._states.get(slots)
        if state is None:
            device = self.device
            state = self._states[slots] = SlotState(
                tokens=torch.empty(slots, dtype=torch.long, device=device),
                lens=torch.empty(slots, dtype=torch.long, device=device),
                live=torch.empty(slots, dtype=torch.bool, device=device),
                row=torch.empty(slots, dtype=torch.long, device=device),
                count=torch.empty(slots, dtype=torch.long, device=device),
                cache=within.cache[:, :, :slots] if within is not None else self.decoder.new_cache(slots, cache_len),
            )
        state.tokens.fill_(self.pad_id)
        state.lens.zero_()
        state.live.zero_()
        state.row.fill_(scratch)
        state.count.zero_()
        return state

    def _compact(self, state: SlotState, keep: Tensor, new: SlotState) -> SlotState:
        """``new`` (a smaller, emptied workspace) holding the slots ``keep`` (in order) of ``state``."""
        n = keep.numel()
        for name in ("tokens", "lens", "live", "row", "count"):
            getattr(new, name)[:n] = getattr(state, name)[keep]
        for layer in range(state.cache.shape[0]):  # gathered (a copy) before written: safe within one allocation
            new.cache[layer, :, :n] = state.cache[layer, :, keep]
        return new

    def cache_length(self, rows: int, positions: int, prompt_tokens: int = 0) -> int:
        """Cache entries a slot holds for rows that need up to ``positions``: :func:`length_bucket`'s (few CUDA graphs;
        a kept workspace seldom grows), or ``positions`` rounded up to 64 where the memory budget's slots hold more
        of the ``rows`` at that length (at 1,024 new tokens the bucket adds up to a fifth: a step whose rows all run
        to the end then needs a second round for the rows that did not fit)."""
        bucket = length_bucket(positions, 1 << 30)  # (no upper limit)
        tight = -(-positions // 64) * 64
        if (tight < bucket and self.refill and not self.max_slots and self.memory_budget is not None
                and self.device.type == "cuda"
                and self.slot_budget(rows, bucket, prompt_tokens) < self.slot_budget(rows, tight, prompt_tokens)):
            return tight
        return bucket

    def slot_budget(self, rows: int, cache_len: int, prompt_tokens: int = 0) -> int:
        """Slots for ``rows`` rows: ``max_slots`` when set; else, with a memory budget (bytes for the whole
        process), as many as :data:`BUDGET_SHARE` of what it leaves holds (each slot's KV cache and its fp32
        logits, a few copies) beside a prefill of the rows' prompts (``prompt_tokens`` each, at most
        :data:`PREFILL_TOKENS` at once); else as many as :data:`FREE_MEMORY_SHARE` of the free GPU memory holds
        (:func:`~scgrpo.rollout.memory.memory_free`; all rows on CPU)."""
        if self.max_slots:
            return max(1, min(rows, self.max_slots))
        if self.device.type != "cuda":
            return rows
        per_row = self.decoder.cache_bytes_per_row(cache_len) + LOGIT_BYTES * self.decoder.embed.shape[0]
        if self.memory_budget is not None:
            allocated = torch.cuda.memory_allocated(self.device)
            prefill = getattr(self.decoder, "prefill_bytes", None)
            tokens = max(prompt_tokens, min(PREFILL_TOKENS, rows * prompt_tokens))  # (a longer prompt: at once)
            workspace = prefill(tokens) if prefill is not None else 0
            if self.memory_budget - allocated - workspace < per_row / BUDGET_SHARE:
                log.warning("the memory budget (%.1f GiB) leaves no room for one row's KV cache (%.2f GiB at %d "
                            "positions) beside the %.1f GiB allocated and %.2f GiB of prefill; decoding one row "
                            "at a time", self.memory_budget / 2**30, per_row / 2**30, cache_len, allocated / 2**30,
                            workspace / 2**30)
            return slots_within(self.memory_budget, allocated, per_row, rows, workspace)
        fit = int(FREE_MEMORY_SHARE * memory_free(self.device) // max(self.decoder.cache_bytes_per_row(cache_len), 1))
        return max(1, min(rows, fit))

    # ------------------------------------------------------------------------------------------ the loop
    @torch.no_grad()
    def __call__(self, prompt_ids: Tensor, prompt_mask: Tensor,
                 reserve: Optional[tuple[int, int]] = None) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded prompts ``[N, Tp]`` -> new tokens ``[N, C]`` (pad after each row's end), the sampler's
        log-probability of each ``[N, C]`` (0 where greedy or padded) and the summed entropy ``[N]``.
        ``reserve`` ``(rows, positions)``: build the workspace for up to that many rows and cache positions (the
        calls of one episode batch then share it)."""
        n = prompt_ids.shape[0]
        self.stats = {"rollout/graphs_recorded": 0.0}
        lengths = prompt_mask.sum(1).long()  # [N]
        if int(lengths.min()) < 1:
            raise ValueError("every prompt needs at least one token")
        right = self._right_padded(prompt_ids, lengths)  # [N, Tp]
        prompt_tokens = int(lengths.max())
        rows, positions = n, prompt_tokens + self.max_new
        if reserve is not None:  # (later calls prefill longer histories, up to the reserved positions)
            rows, positions = max(n, reserve[0]), max(positions, reserve[1])
            prompt_tokens = max(prompt_tokens, reserve[1] - self.max_new)
        out, cache_len = self._workspace(rows, self.cache_length(rows, positions, prompt_tokens))
        if self._top is None:  # decided once per workspace: a budget that moved with free memory would pile up caches
            self._top = rows if not self.refill else self.slot_budget(rows, cache_len, prompt_tokens)
            if self.keep_states:  # (as the graphs that write it, kept with the workspace)
                self._stage = self._new_stage(self._top)
        self.states, self._host = None, None
        if self._stage is not None:
            self._stage.row.fill_(out.tokens.shape[0] - 1)
            self._stage.k.zero_()
            self._staged, self._pending, self._copied = 0, 0, None
            if self.want_states:
                self._host = host_states(n, self.max_new, self._stage.hidden.shape[-1], self._stage.hidden.dtype)
        self._rows = n
        loop = self._decode(out, right, lengths, cache_len)
        self._flush()
        counts = out.count[:n]
        width = max(int(counts.max()), 1) if n else 1
        self._record_stats(loop, counts)
        result = out.tokens[:n, :width].clone(), out.logprobs[:n, :width].clone(), out.entropy[:n].clone()
        if self._host is not None:
            self.states, self._host = self._host[:, :width], None
        if not self.keep_workspace:
            self.release()
        return result

    def _new_stage(self, slots: int) -> Stage:
        hidden = self.decoder.embed.shape[1]
        fit = STAGE_BYTES // max(slots * hidden * self.decoder.embed.element_size(), 1)
        steps = max(self.check_every, min(STAGE_STEPS, fit))
        pinned = self.device.type == "cuda"
        return Stage(hidden=torch.zeros(steps, slots, hidden, dtype=self.decoder.dtype, device=self.device),
                     row=torch.zeros(steps, slots, dtype=torch.long, device=self.device),
                     at=torch.zeros(steps, slots, dtype=torch.long, device=self.device),
                     k=torch.zeros(1, dtype=torch.long, device=self.device),
                     host=torch.empty(steps, slots, hidden, dtype=self.decoder.dtype, pin_memory=pinned),
                     host_row=torch.empty(steps, slots, dtype=torch.long, pin_memory=pinned),
                     host_at=torch.empty(steps, slots, dtype=torch.long, pin_memory=pinned))

    def _room(self, emissions: int) -> None:
        """Makes room in the stage (``keep_states``) for the ``emissions`` about to be written and counts them: empties
        it unless they fit (the host tensor gets its states at the next :meth:`_scatter`)."""
        if self._stage is None:
            return
        if self._staged + emissions > self._stage.row.shape[0]:
            self._flush(wait=False)
        self._staged += emissions

    def _flush(self, wait: bool = True) -> None:
        """Empties the stage (``keep_states``): its entries are copied to the host's buffers (on a GPU without
        waiting: the copy runs before the next steps, which may then write the stage) and, unless ``wait`` is False,
        put into the host tensor at once (else by :meth:`_scatter`, while the next steps run)."""
        stage, k = self._stage, self._staged
        if stage is None or not k:
            return
        if self._host is not None:  # (else nobody reads them: the stage is only emptied)
            self._scatter()
            stage.host[:k].copy_(stage.hidden[:k], non_blocking=True)
            stage.host_row[:k].copy_(stage.row[:k], non_blocking=True)
            stage.host_at[:k].copy_(stage.at[:k], non_blocking=True)
            self._pending = k
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        stage.row.fill_(self._rows)
        stage.k.zero_()
        self._staged = 0
        if wait:
            self._scatter()

    def _scatter(self) -> None:
        """Puts the states last copied from the stage into the host tensor (their rows and columns), once the copy
        is done."""
        stage, k = self._stage, self._pending
        if stage is None or not k:
            return
        if self._copied is not None:
            self._copied.synchronize()
        rows, at = stage.host_row[:k].flatten(), stage.host_at[:k].flatten()
        keep = rows < self._rows
        self._host.index_put_((rows[keep], at[keep]), stage.host[:k].flatten(0, 1)[keep])
        self._pending, self._copied = 0, None

    def _right_padded(self, prompt_ids: Tensor, lengths: Tensor) -> Tensor:
        """The left-padded prompts ``[N, Tp]`` with each row's ``lengths`` real tokens moved to the front (pad
        after them), as the prefill reads them: row i's tokens start at ``Tp - len_i``."""
        tp, device = prompt_ids.shape[1], self.device
        starts = (tp - lengths).unsqueeze(1)
        gather = (starts + torch.arange(tp, device=device)).clamp(max=tp - 1)
        return torch.where(torch.arange(tp, device=device) < lengths.unsqueeze(1),
                           prompt_ids.gather(1, gather), torch.full_like(prompt_ids, self.pad_id))  # [N, Tp]

    def _decode(self, out: Outputs, right: Tensor, lengths: Tensor, cache_len: int) -> LoopStats:
        """Samples every row into ``out``, starting in the full-size workspace: refill, compaction, and bursts
        of ``check_every`` steps between the host's looks at which rows ended."""
        n = right.shape[0]
        loop = LoopStats(slots=self._top)
        state = self._state(loop.slots, cache_len, n)
        pending = deque(range(n))
        while True:
            flags, lens_host, counts_host = self._read(state)
            if pending and self._refill(state, out, right, lengths, pending, flags):
                loop.prefills += 1
                flags, lens_host, counts_host = self._read(state)
            live = [i for i, alive in enumerate(flags) if alive]
            if not live:
                if pending:
                    continue
                break
            lens_host, counts_host = [lens_host[i] for i in live], [counts_host[i] for i in live]
            if not pending and self.compaction:
                smaller = self._maybe_compact(state, live, cache_len, n)
                if smaller is not None:
                    state = smaller
                    loop.compactions += 1
            burst = max(1, min(self.check_every, self.max_new - min(counts_host)))
            # the attention kernel reads each row's own length: one graph per slot count serves every length
            length = cache_len if self.decoder.fused_attention else length_bucket(max(lens_host) + burst, cache_len)
            self._room(burst)
            self._run(state, out, length, burst)
            self._scatter()  # (the states copied before the burst, while it runs)
            loop.steps += burst
            loop.slot_steps += burst * state.slots
        return loop

    @staticmethod
    def _read(state: SlotState) -> list[list[int]]:
        """One device-to-host read: which slots live, their lengths and their rows' token counts."""
        return torch.stack([state.live.long(), state.lens, state.count]).tolist()

    def _refill(self, state: SlotState, out: Outputs, right: Tensor, lengths: Tensor, pending: deque,
                flags: list[int]) -> bool:
        """Gives free slots to waiting rows (``pending``, taken from the left) once a 1/:data:`REFILL_DIVISOR`
        share of the slots, or every waiting row, can be admitted at once; True when it prefilled."""
        free = [i for i, alive in enumerate(flags) if not alive]
        if not free or len(free) < min(len(pending), max(1, state.slots // REFILL_DIVISOR)):
            return False
        take = [pending.popleft() for _ in range(min(len(pending), len(free)))]
        self._admit(state, out, right, lengths, take, free[: len(take)])
        return True

    def _maybe_compact(self, state: SlotState, live: list[int], cache_len: int, rows: int) -> Optional[SlotState]:
        """With at most half of ``state``'s slots ``live``, a smaller workspace (the next power of two, at least
        :data:`MIN_COMPACT_SLOTS`) holding them; None when ``state`` stays."""
        if len(live) > state.slots // 2 or state.slots <= MIN_COMPACT_SLOTS:
            return None
        size = max(MIN_COMPACT_SLOTS, 1 << (len(live) - 1).bit_length())
        keep = torch.tensor(live, dtype=torch.long, device=self.device)
        smaller = self._compact(state, keep, self._state(size, cache_len, rows, within=state))
        if not self.keep_workspace:  # the bigger cache (and its graphs) go now, not after the rollout
            self._states = {k: v for k, v in self._states.items() if k <= size}
            self._prefills.clear()
            self.pool = None  # new graphs take a new pool: the old one dies with its last graph
        return smaller

    def _record_stats(self, loop: LoopStats, counts: Tensor) -> None:
        """:attr:`stats` of a call whose rows made ``counts`` ``[N]`` tokens."""
        n = counts.shape[0]
        projections = self.decoder._projections
        self.stats.update({"rollout/decode_steps": float(loop.steps), "rollout/prefills": float(loop.prefills),
                           "rollout/compactions": float(loop.compactions), "rollout/slots": float(loop.slots),
                           "rollout/compiled": float(self.decoder.compiled and not self.decoder.compile_failed),
                           # share of the projections that dequantize a 4-bit base in every step (four_bit streamed)
                           "rollout/four_bit_streamed": sum(p.mode == "streamed" for p in projections)
                           / max(len(projections), 1),
                           # tokens made by decode steps (each row's first comes from its prefill) per slot-step
                           "rollout/slot_use": float(counts.sum() - n) / max(loop.slot_steps, 1.0)})

    def release(self) -> None:
        """Frees the kept workspaces (KV caches, graphs, output buffers)."""
        self._states.clear()
        self._prefills.clear()
        self._out, self._key, self.pool, self._top, self._stage = None, None, None, None, None

    def _admit(self, state: SlotState, out: Outputs, right: Tensor, lengths: Tensor, rows: list[int],
               slots: list[int]) -> None:
        """Prefills ``rows`` into cache slots ``slots`` and samples their first tokens."""
        device = self.device
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        lens = lengths[row_t]
        width = int(lens.max())
        graphed = self._graphs_prefill()
        span = length_bucket(width, state.cache.shape[4]) if graphed else width  # positions a prefill runs
        chunk = max(1, PREFILL_TOKENS // max(span, 1))  # prompts a prefill runs
        for start in range(0, len(rows), chunk):
            r, s, ln = row_t[start : start + chunk], slot_t[start : start + chunk], lens[start : start + chunk]
            hidden = None
            if graphed:
                logits, hidden = self._graphed_prefill(state, right[r, :width], ln, s, span, chunk)
            elif self._stage is not None:
                logits, hidden = self.decoder.prefill(right[r, :width], ln, s, state.cache, states=True)  # [k, V], [k, H]
            else:
                logits = self.decoder.prefill(right[r, :width], ln, s, state.cache)  # [k, V]
            state.lens[s] = ln
            state.row[s] = r
            state.count[s] = 0
            state.live[s] = True
            self._room(1)
            self._emit(state, out, logits, s, hidden)
            self._scatter()

    def _graphs_prefill(self) -> bool:
        """Prefills run as CUDA graphs: graphs on (:attr:`prefill_graphs`, on by default with them), the prefill's
        kernels running (the eager layers' work includes a host read for padding rows), the workspace kept between
        calls (else each call would record its prefills again) and no memory budget (the recordings keep the
        activations of the largest prefill, and each its logits, while the workspace is kept: memory a budget
        does not count)."""
        return (self.prefill_graphs and self.decoder.prefill_kernels and self.keep_workspace
                and self.memory_budget is None)

    def _graphed_prefill(self, state: SlotState, ids: Tensor, lengths: Tensor, slots: Tensor, span: int,
                         most: int) -> tuple[Tensor, Optional[Tensor]]:
        """:meth:`CompactDecoder.prefill` of ``ids`` ``[k, W]`` replayed from a CUDA graph recorded for the next
        power of two of ``k`` rows (at most ``most``) of ``span`` positions; the padding rows have length 0 (the
        prefill's attention writes no cache entry for them). Returns ``[k, V]`` logits and, with ``keep_states``,
        the ``[k, H]`` final states (else None), valid until the next prefill. A shape not yet recorded is recorded (its warm-up run, on the side stream, is this call's
        prefill; where the prefill's kernels fail there, it falls back to the eager layers and nothing is
        recorded), unless :data:`MAX_PREFILL_GRAPHS` are."""
        k, width = ids.shape
        rows = min(1 << max(k - 1, 0).bit_length(), max(most, k))
        key = (rows, span, state.cache.data_ptr(), tuple(state.cache.shape))
        entry = self._prefills.get(key)
        states = self._stage is not None

        def prefill(*args) -> tuple[Tensor, Optional[Tensor]]:
            out = self.decoder.prefill(*args, state.cache, states=states)
            return out if states else (out, None)

        if entry is None and len(self._prefills) >= MAX_PREFILL_GRAPHS:
            return prefill(ids, lengths, slots)
        if entry is None:
            device = self.device
            entry = PrefillGraph(graph=torch.cuda.CUDAGraph(),
                                 ids=torch.full((rows, span), self.pad_id, dtype=torch.long, device=device),
                                 lengths=torch.zeros(rows, dtype=torch.long, device=device),
                                 slots=torch.zeros(rows, dtype=torch.long, device=device), logits=ids.new_empty(0))
        entry.ids.fill_(self.pad_id)
        entry.ids[:k, :width] = ids
        entry.lengths.zero_()
        entry.lengths[:k] = lengths
        entry.slots.zero_()
        entry.slots[:k] = slots
        if key in self._prefills:
            entry.graph.replay()
            return entry.logits[:k], entry.hidden[:k] if states else None
        stream = warmup_stream(self.device)  # the warm-up run is this call's prefill (it compiles and allocates)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits, hidden = prefill(entry.ids, entry.lengths, entry.slots)
        torch.cuda.current_stream().wait_stream(stream)
        for out in (logits, hidden) if states else (logits,):
            out.record_stream(torch.cuda.current_stream())  # (read there: not reused before that is done)
        if not self.decoder.prefill_kernels:  # its kernels failed (and it fell back to the eager layers)
            return logits[:k], hidden[:k] if states else None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # (as the decode step's recording, a failure here is not caught: a stream capture that failed leaves the
        # device's random generator mid-capture, so no uncaptured fallback would run safely after it)
        with torch.cuda.graph(entry.graph, pool=self.pool):
            entry.logits, entry.hidden = prefill(entry.ids, entry.lengths, entry.slots)
        self._prefills[key] = entry
        self.stats["rollout/graphs_recorded"] = self.stats.get("rollout/graphs_recorded", 0.0) + 1
        return logits[:k], hidden[:k] if states else None
