"""The slot decoder (``scgrpo/rollout/slots.py``, its state in ``slot_state.py``): rows refill the slots of finished
ones and the live ones compact into fewer, without changing what any row samples; admissions, ends of sequence,
prefills, attention-length buckets, and the final states kept for the self-teacher."""

from __future__ import annotations

import pytest
import torch

from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.slot_state import slots_within
from scgrpo.rollout.slots import SlotDecoder, length_bucket
from tests.rollout.test_compact import _forward_states, batch, compact_greedy, hf_greedy, tiny, tok, with_lora  # noqa: F401


def test_slots_within_a_budget_are_what_its_share_leaves_and_at_least_one():
    assert slots_within(budget=1000, allocated=100, per_row=90, rows=64) == 9  # 0.9 x 900 // 90
    assert slots_within(budget=1000, allocated=100, per_row=90, rows=4) == 4  # no more than the rows
    assert slots_within(budget=1000, allocated=900, per_row=90, rows=64, workspace=500) == 1  # at least one


def test_refill_and_compaction_change_no_row(tok):
    model = tiny("llama", len(tok))
    texts = [f"row {i} " + "ab" * (i % 5) for i in range(16)]
    batch = tok(texts, return_tensors="pt", padding=True)
    free_run, _ = compact_greedy(model, batch, 30)
    eos = sorted({int(free_run[i, 2 + (i % 12)]) for i in range(16)})  # rows end at different steps
    plain, plain_sampler = compact_greedy(model, batch, 30, eos, refill=False, compaction=False)
    refill, refill_sampler = compact_greedy(model, batch, 30, eos, max_slots=3)
    compact, compact_sampler = compact_greedy(model, batch, 30, eos, compaction=True)
    assert refill_sampler.stats["rollout/prefills"] > 1
    assert compact_sampler.stats["rollout/compactions"] >= 1
    assert plain_sampler.stats["rollout/compactions"] == 0
    width = plain.shape[1]
    assert torch.equal(refill[:, :width], plain) and torch.equal(compact[:, :width], plain)
    ended = (plain[:, :, None] == torch.tensor(eos)).any(-1)
    assert len(set(ended.int().argmax(1).tolist())) > 2  # the rows really did end at different steps
    reference = hf_greedy(model, batch, 30, eos)
    assert torch.equal(plain[:, : reference.shape[1]], reference[:, : plain.shape[1]])

    # without kept workspaces a compaction frees the bigger cache at once, and the rollout frees the rest
    lean = SlotDecoder(CompactDecoder(model), eos, 2, 30, greedy=True)
    lean.keep_workspace = False
    held, run = [], lean._run
    lean._run = lambda state, *args: (held.append((state.slots, sorted(lean._states),
                                                   state.cache.untyped_storage().data_ptr())), run(state, *args))[1]
    tokens = lean(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens[:, :width], plain) and lean.stats["rollout/compactions"] >= 1
    assert all(sizes == [slots] for slots, sizes, _ in held) and held[0][0] > held[-1][0]
    assert len({storage for _, _, storage in held}) == 1  # compaction moves rows within the one cache allocation
    assert lean._states == {}


def test_admissions_wait_for_a_quarter_of_the_slots(tok):
    """Waiting rows are prefilled in groups (a quarter of the slots, or all that wait): fewer, bigger prefills,
    and no row's tokens change."""
    model = tiny("llama", len(tok))
    batch = tok([f"row {i} " + "ab" * (i % 5) for i in range(32)], return_tensors="pt", padding=True)
    free_run, _ = compact_greedy(model, batch, 30)
    eos = sorted({int(free_run[i, 3 + 2 * i]) for i in (0, 5, 9)})  # rows end one or two at a time
    plain, _ = compact_greedy(model, batch, 30, eos, refill=False, compaction=False)
    sampler = SlotDecoder(CompactDecoder(model), eos, 2, 30, greedy=True, max_slots=16)
    sizes, admit = [], sampler._admit
    sampler._admit = lambda state, out, right, lengths, rows, slots: (sizes.append(len(rows)),
                                                                      admit(state, out, right, lengths, rows, slots))
    tokens = sampler(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens[:, : plain.shape[1]], plain)
    assert sizes[0] == 16 and sum(sizes) == 32 and len(sizes) > 2 and all(size >= 4 for size in sizes[:-1])


def test_eos_ends_a_row_and_pads_after_it(tok, batch):
    model = tiny("llama", len(tok))
    free_run, _ = compact_greedy(model, batch, 12)
    eos = int(free_run[0, 4])
    tokens, _ = compact_greedy(model, batch, 12, [eos])
    first = int((tokens[0] == eos).int().argmax())
    assert first <= 4 and bool((tokens[0, first + 1:] == 2).all())


def test_length_buckets():
    assert [length_bucket(n, 4096) for n in (1, 64, 65, 1024, 1025, 5000)] == [64, 64, 128, 1024, 1280, 4096]


def test_padding_rows_of_a_prefill_store_nothing(tok, batch):
    """Rows of length 0 (a recorded prefill's shape filled up) write no cache entry, even into a slot another row
    uses, and leave the other rows' logits as a prefill without them gives."""
    decoder = CompactDecoder(tiny("llama", len(tok)))
    lengths = batch["attention_mask"][:3].sum(1)
    ids = torch.stack([torch.cat([r[r != 2], r[r == 2]]) for r in batch["input_ids"][:3]])  # right-padded
    alone = decoder.new_cache(4, 64)
    expected = decoder.prefill(ids, lengths, torch.tensor([0, 1, 2]), alone)
    padded = decoder.new_cache(4, 64)
    got = decoder.prefill(torch.cat([ids, ids[:2]]), torch.cat([lengths, torch.zeros(2, dtype=torch.long)]),
                          torch.tensor([0, 1, 2, 1, 3]), padded)
    assert torch.allclose(got[:3], expected, atol=1e-6)
    assert torch.equal(padded, alone)  # slot 1 kept its row's entries, slot 3 stayed empty


def test_prefills_are_recorded_only_with_kept_workspaces_and_no_memory_budget(tok):
    """Recorded prefills keep their activations and logits while the workspace is kept: not under a memory budget
    (which does not count them), nor where each call frees its workspace (each would record again)."""
    decoder = CompactDecoder(tiny("llama", len(tok)))
    decoder.prefill_kernels = True  # (as on a GPU with Triton)

    def records(**kwargs) -> bool:
        sampler = SlotDecoder(decoder, [], 2, 4, memory_budget=kwargs.pop("memory_budget", None))
        sampler.prefill_graphs = True  # (as on a GPU)
        sampler.keep_workspace = kwargs.pop("keep_workspace", True)
        return sampler._graphs_prefill()

    assert records()
    assert not records(memory_budget=20 * 2**30)
    assert not records(keep_workspace=False)


@pytest.mark.parametrize("stage", [None, 3])
@pytest.mark.parametrize("slots", [dict(), dict(max_slots=3), dict(compaction=True)])
def test_kept_states_are_the_policys_final_states_before_each_token(tok, slots, stage, monkeypatch):
    """With ``keep_states`` the sampler hands back, for every token it drew, the final hidden state the head read
    (the prefill's for the first, a decode step's for the others), in the row and column of the token: a forward
    pass over prompt and completion gives the same states, whichever slot a row sat in (refill, compaction), and the
    tokens are those sampled without it. A state one column off, or another row's, would differ. A stage of 3 steps
    is emptied many times on the way (between steps and between admissions)."""
    import scgrpo.rollout.slots as slots_module

    if stage is not None:
        monkeypatch.setattr(slots_module, "STAGE_STEPS", stage)
    model = with_lora(tiny("llama", len(tok)))
    batch = tok([f"row {i} " + "ab" * (i % 5) for i in range(16)], return_tensors="pt", padding=True)
    free_run, _ = compact_greedy(model, batch, 12)
    eos = sorted({int(free_run[i, 2 + (i % 9)]) for i in range(0, 16, 2)})  # rows end at different steps
    plain, _ = compact_greedy(model, batch, 12, eos, **slots)
    sampler = SlotDecoder(CompactDecoder(model), eos, 2, 12, greedy=True, keep_states=True, **slots)
    flushes, flush = [], sampler._flush
    sampler._flush = lambda **kwargs: (flushes.append(sampler._staged), flush(**kwargs))[1]
    tokens = sampler(batch["input_ids"], batch["attention_mask"])[0]
    emptied = [k for k in flushes if k]
    assert max(emptied) <= (stage or 64) and (len(emptied) >= 3 if stage else len(emptied) == 1)
    assert torch.equal(tokens, plain)
    if slots:
        assert sampler.stats["rollout/prefills"] + sampler.stats["rollout/compactions"] > 1
    states = sampler.states
    assert states.shape == (*tokens.shape, 32) and states.dtype == torch.float32
    ended = (tokens[:, :, None] == torch.tensor(eos)).any(-1).int()
    mask = (ended.cumsum(1) - ended) == 0  # each row's tokens up to its end-of-sequence
    assert not mask.all()
    expected = _forward_states(model, batch, tokens)
    torch.testing.assert_close(states[mask], expected[mask], atol=1e-5, rtol=1e-4)
    assert (states[:, 1:][mask[:, 1:]] - expected[:, :-1][mask[:, 1:]]).abs().max() > 1e-2  # one column off
    both = mask & mask.roll(1, 0)  # (past a row's end its states are undefined: compared where both rows hold tokens)
    assert (states.roll(1, 0)[both] - expected[both]).abs().max() > 1e-2  # another row's
    # a second call reuses the workspace and hands back its own states
    again = sampler(batch["input_ids"][:5], batch["attention_mask"][:5])[0]
    first = {k: v[:5] for k, v in batch.items()}
    mask = torch.ones_like(again, dtype=torch.bool).logical_and(
        (((again[:, :, None] == torch.tensor(eos)).any(-1).int().cumsum(1)
          - (again[:, :, None] == torch.tensor(eos)).any(-1).int()) == 0))
    torch.testing.assert_close(sampler.states[mask], _forward_states(model, first, again)[mask], atol=1e-5, rtol=1e-4)


def test_states_are_kept_only_when_asked_for(tok, batch):
    """A sampler is rebuilt once to keep states (its steps write the stage); it then serves calls without them too
    (evaluation at the training temperature), which hand none back, without another rebuild."""
    from scgrpo.rollout.backends import CompactSampler

    model = tiny("llama", len(tok))
    settings = GenerationSettings(max_new_tokens=6)
    backend = CompactSampler()
    assert generate(model, tok, ["hi", "there"], 2, settings, torch.device("cpu"), sampler=backend).states is None
    (plain,) = backend.decoders[model]["samplers"].values()
    assert not plain.keep_states
    out = generate(model, tok, ["hi", "there"], 2, settings, torch.device("cpu"), states=True, sampler=backend)
    assert out.states.shape == (4, out.completion_ids.shape[1], 32)
    (keeping,) = backend.decoders[model]["samplers"].values()
    assert keeping is not plain and keeping.keep_states
    again = generate(model, tok, ["hi", "there"], 2, settings, torch.device("cpu"), sampler=backend)
    assert again.states is None and list(backend.decoders[model]["samplers"].values()) == [keeping]
    assert keeping._host is None and keeping.states is None
    torch.manual_seed(0)
    last = generate(model, tok, ["hi", "there"], 2, settings, torch.device("cpu"), states=True, sampler=backend)
    assert list(backend.decoders[model]["samplers"].values()) == [keeping]
    encoded = tok(["hi", "there"], return_tensors="pt", padding=True, add_special_tokens=False)
    batch = {k: v.repeat_interleave(2, 0) for k, v in encoded.items()}
    expected = _forward_states(model, batch, last.completion_ids)  # (a tiny model seldom ends early: 6 tokens each)
    mask = last.completion_mask.bool()
    torch.testing.assert_close(last.states[mask], expected[mask], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="student_states"):
        GenerationSettings(student_states="sampler")
