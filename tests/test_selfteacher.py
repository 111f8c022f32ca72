"""The self-teacher: routing by n_c, reference rules, the teacher's inputs and its per-token divergences
against an independent forward pass; and the verified-trajectory buffer."""

import pytest
import torch

from scgrpo.data.buffer import VerifiedBuffer
from scgrpo.objectives import SCGRPO
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.types import RolloutBatch
from scgrpo.selfteacher import (
    ALL, PARTIAL, SINGLE, SOLVE_NONE, ROUTES, TeacherSpec, group_routes, route_rollouts, system_prompt_layout)
from tests.helpers import tiny_module

SC_ROUTES = TeacherSpec().routes  # SC-GRPO's defaults: partial-solve and solve-none


def _rollouts(rewards, tokens, group_size=4, ids=None):
    """Rows with the given completion tokens (each ends in EOS = 2); text = the tokens as a string."""
    n = len(rewards)
    width = max(len(t) for t in tokens) + 1
    completion_ids = torch.full((n, width), 2)
    mask = torch.zeros(n, width)
    for i, t in enumerate(tokens):
        completion_ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t) + 1] = 1.0
    return RolloutBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long), prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=completion_ids, completion_mask=mask, truncated=torch.zeros(n, dtype=torch.bool),
        group_size=group_size, sample_ids=ids or [f"p{i // group_size}" for i in range(n)], questions=["q"] * n,
        answers=[7] * n, completions=[" ".join(map(str, t)) for t in tokens], rewards=torch.tensor(rewards),
    )


@pytest.mark.parametrize("n_c", range(5))
def test_routing_for_every_number_of_correct_rollouts(n_c):
    """G = 4, distinct completions, the first n_c correct. Partial-solve (n_c = 2, 3): every row's reference is
    a correct sibling, never itself. Solve-none (0): one reference row, the other three conditioned on it.
    Single (1) and all-correct (4): no teacher (plain GRPO)."""
    tokens = [[10 + i] * (i + 1) for i in range(4)]  # lengths 1, 2, 3, 4
    rewards = [1.0] * n_c + [0.0] * (4 - n_c)
    rollouts = _rollouts(rewards, tokens)
    plan = route_rollouts(rollouts, TeacherSpec(routes=SC_ROUTES), 1.0, step=3)
    expected_route = {0: SOLVE_NONE, 1: SINGLE, 2: PARTIAL, 3: PARTIAL, 4: ALL}[n_c]
    assert plan.route == [expected_route] * 4
    if n_c in (2, 3):
        for i in range(4):
            j = plan.reference_rows[i]
            assert j is not None and j != i and rewards[j] == 1.0
            assert plan.references[i] == rollouts.completions[j]
        assert not any(plan.is_reference)
    elif n_c == 0:
        (r,) = [i for i in range(4) if plan.is_reference[i]]
        assert plan.references[r] is None
        for i in range(4):
            if i != r:
                assert plan.reference_rows[i] == r
                assert plan.diversity_length[i] == min(len(tokens[i]), len(tokens[r])) + 1  # + EOS
    else:
        assert plan.references == [None] * 4


def test_routing_ablations_turn_single_and_all_correct_groups_on():
    tokens = [[10 + i] * (i + 1) for i in range(8)]
    rollouts = _rollouts([1.0, 0, 0, 0, 1, 1, 1, 1], tokens)
    plan = route_rollouts(rollouts, TeacherSpec(routes=ROUTES), 1.0)
    # single-correct: the three wrong rows see the correct one; the correct one has no other correct sibling
    assert [plan.reference_rows[i] for i in range(4)] == [None, 0, 0, 0]
    assert all(plan.reference_rows[i] not in (None, i) for i in range(4, 8))


def test_a_token_identical_sibling_is_never_a_reference():
    """Rows 0 and 1 are correct and token-identical, row 2 correct and different: 0 and 1 may only see 2, and
    2 sees 0 or 1. With only identical correct rows, a correct row has no teacher (weight 1) unless the
    buffer supplies a completion with other tokens."""
    rollouts = _rollouts([1.0, 1.0, 1.0, 0.0], [[5, 6], [5, 6], [7], [8]])
    for step in range(20):
        plan = route_rollouts(rollouts, TeacherSpec(), 1.0, step=step)
        assert plan.reference_rows[0] == 2 and plan.reference_rows[1] == 2 and plan.reference_rows[2] in (0, 1)
    twins = _rollouts([1.0, 1.0, 0.0, 0.0], [[5, 6], [5, 6], [7], [8]])
    plan = route_rollouts(twins, TeacherSpec(), 1.0)
    assert plan.references[:2] == [None, None] and plan.reference_rows[2] in (0, 1)
    buffer = VerifiedBuffer(4)
    buffer.add("p0", [5, 6, 2], "5 6", 1.0, step=0)  # the same tokens as rows 0 and 1: never shown to them
    buffer.add("p0", [9, 2], "older", 1.0, step=0)
    plan = route_rollouts(twins, TeacherSpec(buffer_references=True), 1.0, buffer)
    assert plan.references[:2] == ["older", "older"] and plan.reference_rows[:2] == [None, None]
    assert route_rollouts(twins, TeacherSpec(buffer_references=False), 1.0, buffer).references[:2] == [None, None]


def test_reference_choice_is_seeded_and_does_not_depend_on_the_split_over_ranks():
    tokens = [[10 + i] for i in range(8)]
    rollouts = _rollouts([1.0] * 6 + [0.0] * 2, tokens, group_size=8, ids=["p"] * 8)
    first = route_rollouts(rollouts, TeacherSpec(seed=3), 1.0, step=5).reference_rows
    assert first == route_rollouts(rollouts, TeacherSpec(seed=3), 1.0, step=5).reference_rows
    assert any(route_rollouts(rollouts, TeacherSpec(seed=s), 1.0, step=5).reference_rows != first for s in range(4, 9))
    two = _rollouts([1.0, 0, 1, 0, 0, 0, 0, 0], [[10 + i] for i in range(8)], group_size=4)
    whole = route_rollouts(two, TeacherSpec(), 1.0, step=1).references
    second = route_rollouts(two.select(torch.arange(4, 8)), TeacherSpec(), 1.0, step=1).references
    assert whole[4:] == second  # the second group, routed alone (as another rank would), draws the same


def test_privileged_teachers_see_the_ground_truth_answer_in_every_row():
    rollouts = _rollouts([0.0, 0.0, 1.0, 0.0], [[1], [2], [3], [4]])
    plan = route_rollouts(rollouts, TeacherSpec(routes=(), privileged=True), 1.0)
    assert plan.references == ["7"] * 4


def test_group_routes():
    rewards = torch.tensor([0.0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0.5, 1, 0, 0])
    assert group_routes(rewards, 4, 1.0).tolist() == [SOLVE_NONE, SINGLE, PARTIAL, PARTIAL, ALL, SINGLE]


# ------------------------------------------------------------------------ teacher inputs and divergences
def _sampled(module, rewards, questions, g=4):
    """Rollouts sampled from the tiny model: left-padded prompts of different lengths, EOS at different places."""
    torch.manual_seed(0)
    prompts = module.actor.format_prompts(questions)
    out = generate(module.policy, module.tokenizer, prompts, g, GenerationSettings(max_new_tokens=10), module.device)
    n = len(questions) * g
    ids, mask = out.completion_ids.clone(), out.completion_mask.clone()
    for i in range(n):  # end-of-sequence at different places (a random tiny model rarely samples it)
        end = 2 + (3 * i) % (ids.shape[1] - 2)
        ids[i, end], ids[i, end + 1 :], mask[i, end + 1 :], mask[i, : end + 1] = 2, 2, 0.0, 1.0
    texts = module.tokenizer.batch_decode(ids, skip_special_tokens=True)
    return RolloutBatch(out.prompt_ids, out.prompt_mask, ids, mask, out.truncated, g,
                        [f"q{i // g}" for i in range(n)], [q for q in questions for _ in range(g)], [0] * n,
                        texts, rewards=torch.tensor(rewards))


def _independent_divergence(module, rollouts, row, reference, system_text):
    """D on the row's real tokens from two plain full forwards over *unpadded* sequences: the teacher's chat
    (system = base + guide + reference, user = the question) and the student's own prompt."""
    tok, policy = module.tokenizer, module.policy
    length = int(rollouts.completion_mask[row].sum())
    completion = rollouts.completion_ids[row, :length]
    question = rollouts.questions[row]
    block = SCGRPO().teacher.template.format(reference=reference)
    teacher_prompt = tok.apply_chat_template(
        [{"role": "system", "content": f"{system_text}\n\n{block}" if system_text else block},
         {"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    student_prompt = module.actor.format_prompts([question])[0]

    def logprobs(prompt):
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        full = torch.cat([ids, completion]).unsqueeze(0)
        with torch.no_grad():
            logits = policy(input_ids=full).logits[0].double()
        return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + length], -1), logits, len(ids)

    t, t_logits, t_len = logprobs(teacher_prompt)
    s, s_logits, s_len = logprobs(student_prompt)
    forward = (t.exp() * (t - s)).sum(-1)
    # variants the test must tell apart from the right one
    shifted = torch.log_softmax(t_logits[t_len : t_len + length], -1)
    return forward, {"swapped": (s.exp() * (s - t)).sum(-1),
                     "off_by_one": (shifted.exp() * (shifted - s[: shifted.shape[0]])).sum(-1)}


def test_teacher_sees_the_reference_in_its_system_message_and_scores_the_same_tokens(tiny_model_dir):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    with torch.no_grad():  # sharper distributions than a random init gives: KLs of ~0.1-1, not ~1e-3
        module.policy.get_base_model().model.norm.weight.mul_(8.0)
    questions = ["What is 1 + 1?", "What is 23 + 4 and then what is 5 times 6 exactly?"]  # different prompt lengths
    rollouts = _sampled(module, [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0], questions)
    lengths = rollouts.completion_mask.sum(1)
    assert (rollouts.prompt_mask == 0).any() and len(set(lengths.tolist())) > 1
    signal = module.run_self_teacher(rollouts)
    assert signal.has_teacher.all()
    has_system, base = system_prompt_layout(module.tokenizer, None)
    assert has_system and base == ""  # the test template has no default system message
    # the teacher's text: reference in the system turn only, the user turn is the student's question
    ids, _, _ = module.self_teacher.teacher_inputs(module.actor, rollouts, [2], [signal.references[2]])
    # rows sharing a question and a reference are rendered once: the ids are those of each row rendered alone
    rows = [r for r in range(8) if signal.references[r] is not None]
    together, _ = module.self_teacher.teacher_prompt_ids(module.actor, rollouts, rows, [signal.references[r] for r in rows])
    assert len(set(map(tuple, together))) < len(rows)  # (some rows share both here)
    for row, got in zip(rows, together):
        alone = module.self_teacher.teacher_prompts(module.actor, [rollouts.questions[row]], [signal.references[row]])
        assert got == module.tokenizer(alone, add_special_tokens=False)["input_ids"][0]
    text = module.tokenizer.decode(ids[0], skip_special_tokens=False)
    system_part, user_part = text.split("<|im_start|>user\n")
    assert signal.references[2] in system_part and "<|im_start|>system" in system_part
    assert user_part.startswith(questions[0] + "<|im_end|>")
    for row in range(8):
        length = int(lengths[row])
        expected, wrong = _independent_divergence(module, rollouts, row, signal.references[row], base)
        torch.testing.assert_close(signal.divergence[row, :length].double(), expected, atol=2e-5, rtol=1e-4)
        assert (signal.divergence[row, length:] == 0).all()
        for name, value in wrong.items():
            n = min(len(value), length)
            assert (signal.divergence[row, :n].double() - value[:n]).abs().max() > 1e-3, name
    # another row's reference gives other divergences
    row, other = 0, next(r for r in range(4, 8) if signal.references[r] != signal.references[0])
    misplaced, _ = _independent_divergence(module, rollouts, row, signal.references[other], base)
    assert (signal.divergence[row, : len(misplaced)].double() - misplaced).abs().max() > 1e-3


def test_template_default_system_prompt_is_kept_under_the_reference():
    """SmolLM2-like templates insert a default system message when none is given: the teacher keeps it."""
    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    assert system_prompt_layout(tok, None) == (True, "You are helpful.")
    assert system_prompt_layout(tok, "Be brief.") == (True, "Be brief.")
    tok.chat_template = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('no') }}"
                         "{% endif %}{{ message['content'] }}{% endfor %}")
    assert system_prompt_layout(tok, None) == (False, "")


def test_teacher_and_entropy_passes_run_without_dropout(tiny_model_dir):
    """LoRA dropout 0.5: two teacher passes (and two entropy passes) under different RNG states agree, so the
    teacher and the student see the same network."""
    from scgrpo.models import LoraSettings

    module = tiny_module(tiny_model_dir, objective=SCGRPO(),
                         lora=LoraSettings(r=4, alpha=8, dropout=0.5, extra={"init_lora_weights": False}))
    module.configure_model()
    rollouts = _sampled(module, [1.0, 1.0, 0.0, 0.0], ["What is 1 + 1?"])
    module.policy.train()
    torch.manual_seed(1)
    first = module.run_self_teacher(rollouts).divergence
    torch.manual_seed(2)
    second = module.run_self_teacher(rollouts).divergence
    assert torch.equal(first, second) and first.abs().sum() > 0
    torch.manual_seed(1)
    e1 = module.actor.batch_entropy(rollouts, module.micro_batch_size)
    torch.manual_seed(2)
    assert torch.equal(e1, module.actor.batch_entropy(rollouts, module.micro_batch_size))
    assert module.policy.training  # the passes restore train mode


def test_a_reference_too_long_for_the_model_is_cut_and_counted(tiny_model_dir):
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    rollouts = _sampled(module, [1.0, 1.0, 0.0, 0.0], ["What is 1 + 1?"])
    limit = module.policy.config.max_position_embeddings  # 512 for the tiny model
    rollouts.completions[0] = "HEAD " + "7 " * 400 + "TAIL"  # 800+ byte-level tokens
    rollouts.completions[1] = rollouts.completions[0]
    ids, mask, cut = module.self_teacher.teacher_inputs(module.actor, rollouts, [1, 2], [rollouts.completions[0], "short"])
    assert cut == 1 and ids.shape[1] <= limit
    text = module.tokenizer.decode(ids[0], skip_special_tokens=False)
    assert "TAIL" in text and "HEAD" not in text  # the reference keeps its end (where the answer is)
    assert "short" in module.tokenizer.decode(ids[1])  # the other row is untouched
    signal = module.run_self_teacher(rollouts)
    assert signal.stats.truncated_references >= 1
    rollouts.questions = ["x" * 1000] * 4  # even an empty reference cannot fit
    with pytest.raises(ValueError, match="maximum of 512"):
        module.run_self_teacher(rollouts)


def test_buffer_deduplicates_caps_and_round_trips():
    buffer = VerifiedBuffer(size_per_prompt=2, max_total=3)
    buffer.add("x", [1], "one", 1.0, 0)
    buffer.add("x", [2], "two", 1.0, 1)
    buffer.add("x", [1], "one", 1.0, 2)  # duplicate: becomes the most recent
    assert [e.text for e in buffer.get("x")] == ["two", "one"] and len(buffer) == 2
    buffer.add("x", [3], "three", 1.0, 3)  # per-prompt cap drops the oldest ("two")
    assert [e.text for e in buffer.get("x")] == ["one", "three"]
    buffer.add("y", [4], "four", 1.0, 4)
    buffer.add("z", [5], "five", 1.0, 5)  # global cap 3: the prompt updated longest ago ("x") loses its oldest
    assert len(buffer) == 3 and [e.text for e in buffer.get("x")] == ["three"]
    restored = VerifiedBuffer(size_per_prompt=2, max_total=3)
    restored.load_state_dict(buffer.state_dict())
    assert restored.state_dict() == buffer.state_dict() and len(restored) == 3


def test_heatmap_draws_rows_of_every_route_present():
    from scgrpo.callbacks.credit import CreditLogging
    from tests.objectives.test_scgrpo import _signal

    route = [SOLVE_NONE] * 4 + [PARTIAL] * 4 + [ALL] * 4 + [PARTIAL] * 4
    has_teacher = [False, True, True, True] + [False, True, True, True] + [False] * 4 + [True] * 4
    signal = _signal(route, has_teacher, torch.zeros(16, 3))
    rows = CreditLogging(num_rollouts=8).pick_rows(signal, 4)
    assert rows == [4 + 1, 4 + 2, 1, 2, 8, 9]  # partial (first group), solve-none, all-correct; teacher rows first
    assert CreditLogging(num_rollouts=3).pick_rows(signal, 4) == [5, 6, 1]


def test_fitting_references_cuts_only_what_does_not_fit_and_warns_once(caplog):
    """A model of 40 positions, 10 completion slots: a 20-token prompt fits; a 45-token one loses 15 + 1
    reference tokens from the start of its reference (its end is kept); the warning is logged once, and not
    before anything was cut."""
    import logging
    from types import SimpleNamespace

    from scgrpo.selfteacher import SelfTeacher
    from tests.conftest import build_tokenizer

    tok = build_tokenizer()
    policy = SimpleNamespace(tokenizer=tok, model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40)))
    teacher = SelfTeacher(TeacherSpec())
    reference = "abcdefghijklmnopqrstuvwxyz0123"  # 30 tokens (one byte each)
    with caplog.at_level(logging.WARNING, logger="scgrpo.selfteacher"):
        refs, cut = teacher._fit_references(policy, ["q"], [reference], [list(range(20))], 10)
        assert refs == [reference] and cut == [] and "cut from their start" not in caplog.text
        refs, cut = teacher._fit_references(policy, ["q", "q"], [reference, reference],
                                            [list(range(45)), list(range(5))], 10)
        assert cut == [0] and refs == [reference[16:], reference]
        teacher._fit_references(policy, ["q"], [reference], [list(range(45))], 10)
    assert caplog.text.count("cut from their start") == 1


def test_a_base_teacher_needs_adapters():
    from types import SimpleNamespace

    from scgrpo.selfteacher import SelfTeacher

    policy = SimpleNamespace(model=torch.nn.Linear(2, 2), completion_hidden=lambda *args, **kwargs: torch.zeros(1))
    with pytest.raises(ValueError, match="needs LoRA"):
        SelfTeacher(TeacherSpec(weights="base"))._teacher_hidden(policy, None, None, 1)
    assert SelfTeacher(TeacherSpec())._teacher_hidden(policy, None, None, 1).shape == (1,)  # the policy itself


def test_a_base_teacher_runs_the_policy_with_its_adapters_disabled():
    import contextlib
    from types import SimpleNamespace

    from scgrpo.selfteacher import SelfTeacher

    state = {"disabled": False}

    @contextlib.contextmanager
    def disable_adapter():
        state["disabled"] = True
        yield
        state["disabled"] = False

    policy = SimpleNamespace(model=SimpleNamespace(disable_adapter=disable_adapter),
                             completion_hidden=lambda *args, **kwargs: torch.tensor([float(state["disabled"])]))
    assert SelfTeacher(TeacherSpec(weights="base"))._teacher_hidden(policy, None, None, 1).tolist() == [1.0]
    assert SelfTeacher(TeacherSpec())._teacher_hidden(policy, None, None, 1).tolist() == [0.0]  # adapters on


@pytest.mark.parametrize("window, min_tokens", [("pair", 1), ("group", 1), ("pair", 3), ("group", 3)])
def test_solve_none_windows_pair_or_group_and_a_minimum(window, min_tokens):
    """G = 4 all wrong, completions of 1, 2, 3 and 4 tokens (+ EOS: 2 to 5 model tokens). "pair": L_i = min(|o_i|,
    |o_r|); "group": the group's shortest, 2, for every row; below ``min_tokens`` a row's window is 0 (no score)."""
    tokens = [[10 + i] * (i + 1) for i in range(4)]
    rollouts = _rollouts([0.0] * 4, tokens)
    spec = TeacherSpec(routes=SC_ROUTES, diversity_window=window, diversity_min_tokens=min_tokens)
    plan = route_rollouts(rollouts, spec, 1.0, step=3)
    (r,) = [i for i in range(4) if plan.is_reference[i]]
    for i in range(4):
        if i == r:
            assert plan.diversity_length[i] == 0
            continue
        length = min(len(tokens[i]), len(tokens[r])) + 1 if window == "pair" else 2
        assert plan.diversity_length[i] == (length if length >= min_tokens else 0)


def test_diversity_options_are_checked():
    with pytest.raises(ValueError, match="diversity_window"):
        TeacherSpec(diversity_window="row")
    with pytest.raises(ValueError, match="diversity_min_tokens"):
        SCGRPO(diversity_min_tokens=0)
    assert SCGRPO(diversity_window="group", diversity_min_tokens=4).teacher.diversity_min_tokens == 4


def test_the_group_window_counts_the_reference_when_it_is_the_shortest():
    """The group's shortest rollout may be the reference itself: its length is every row's window under "group"."""
    probe = route_rollouts(_rollouts([0.0] * 4, [[10, 11]] * 4), TeacherSpec(routes=SC_ROUTES), 1.0, step=3)
    (r,) = [i for i in range(4) if probe.is_reference[i]]
    tokens = [[10 + i] * (1 if i == r else 3 + i) for i in range(4)]  # the reference: 1 token (+ EOS = 2)
    spec = TeacherSpec(routes=SC_ROUTES, diversity_window="group")
    plan = route_rollouts(_rollouts([0.0] * 4, tokens), spec, 1.0, step=3)
    assert plan.is_reference[r]
    assert [plan.diversity_length[i] for i in range(4) if i != r] == [2, 2, 2]


def test_the_samplers_kept_states_give_the_forwards_divergences_without_a_student_pass(tiny_model_dir):
    """``generation.student_states: rollout``: the rollouts carry the sampler's final states, the teacher pass runs
    the teacher's rows alone (no student forward) and D equals the forward's (fp32 on a CPU: to rounding); the
    states are dropped once read. States one column off give other divergences."""
    from scgrpo.rollout.types import PromptBatch

    module = tiny_module(tiny_model_dir, objective=SCGRPO(),
                         generation=GenerationSettings(num_generations=4, max_new_tokens=10, student_states="rollout"))
    module.setup("fit")
    with torch.no_grad():  # sharper distributions (see the test above)
        module.policy.get_base_model().model.norm.weight.mul_(8.0)
    assert module.rollout_stage.states
    questions = ["What is 1 + 1?", "What is 23 + 4 and then what is 5 times 6 exactly?"]
    torch.manual_seed(0)
    rollouts = module.rollout_stage.sample(PromptBatch(ids=["q0", "q1"], questions=questions, answers=[2, 27]))
    assert rollouts.student_states is not None and rollouts.student_states.device.type == "cpu"
    assert rollouts.student_states.shape == (*rollouts.completion_ids.shape, module.policy.config.hidden_size)
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # partial-solve and solve-none
    states = rollouts.student_states
    student_passes = []
    span_hidden = module.actor.span_hidden
    module.actor.span_hidden = lambda *args, **kwargs: (student_passes.append(1), span_hidden(*args, **kwargs))[1]
    kept = module.run_self_teacher(rollouts)
    assert not student_passes and rollouts.student_states is states  # (read, not dropped: the step drops them)
    rollouts.student_states = None
    forward = module.run_self_teacher(rollouts)  # (no states now: the student's forward pass)
    assert student_passes
    assert kept.has_teacher.sum() == 7 and forward.divergence.abs().sum() > 1.0
    torch.testing.assert_close(kept.divergence, forward.divergence, atol=2e-5, rtol=1e-4)
    rollouts.student_states = torch.cat([states[:, :1], states[:, :-1]], 1)  # one column late
    assert (module.run_self_teacher(rollouts).divergence - forward.divergence).abs().max() > 1e-2


def test_kept_states_past_a_rows_end_are_never_read(tiny_model_dir, monkeypatch):
    """The sampler leaves the states past each row's end unwritten (uninitialised host memory): here they hold NaN,
    rows end early (a token they drew made an end-of-sequence), and D is still finite and the forward's."""
    import scgrpo.rollout.slots as slots_module
    from scgrpo.rollout.types import PromptBatch

    monkeypatch.setattr(slots_module, "host_states", lambda rows, columns, hidden, dtype: torch.full(
        (rows, columns, hidden), float("nan"), dtype=dtype))
    module = tiny_module(tiny_model_dir, objective=SCGRPO(),
                         generation=GenerationSettings(num_generations=4, max_new_tokens=10, student_states="rollout"))
    module.setup("fit")
    with torch.no_grad():  # sharper distributions (see the tests above)
        module.policy.get_base_model().model.norm.weight.mul_(8.0)
    batch = PromptBatch(ids=["q0", "q1"], questions=["What is 1 + 1?", "What is 23 + 4?"], answers=[2, 27])
    torch.manual_seed(0)
    free = module.rollout_stage.sample(batch).completion_ids
    config = module.policy.get_base_model().generation_config
    config.eos_token_id = sorted({int(free[i, 2 + i % 5]) for i in range(0, 8, 2)})  # rows end at different steps
    torch.manual_seed(0)
    rollouts = module.rollout_stage.sample(batch)
    mask = rollouts.completion_mask.bool()
    assert len(set(mask.sum(1).tolist())) > 2  # rows of several lengths
    assert rollouts.student_states[~mask].isnan().all() and not rollouts.student_states[mask].isnan().any()
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    student_passes = []
    span_hidden = module.actor.span_hidden
    module.actor.span_hidden = lambda *args, **kwargs: (student_passes.append(1), span_hidden(*args, **kwargs))[1]
    kept = module.run_self_teacher(rollouts)
    assert not student_passes  # (the sampler's states, no student forward)
    rollouts.student_states = None  # (as the step drops them)
    forward = module.run_self_teacher(rollouts)  # (the student's forward pass)
    assert student_passes and forward.divergence[mask].abs().sum() > 1.0
    assert kept.divergence.isfinite().all() and (kept.divergence[~mask] == 0).all()
    torch.testing.assert_close(kept.divergence, forward.divergence, atol=2e-5, rtol=1e-4)


def test_rollout_states_are_asked_for_where_they_serve(tiny_model_dir):
    """"auto" keeps the sampler's states on a GPU only (a CPU run keeps the forward's numerics); objectives
    without divergences, and episodes, never ask."""
    from scgrpo.objectives import GRPO
    from scgrpo.selfteacher import keeps_sampler_states

    def wants(objective, mode, device=torch.device("cpu"), episodes=False, max_new_tokens=16):
        generation = GenerationSettings(num_generations=4, student_states=mode, max_new_tokens=max_new_tokens)
        return keeps_sampler_states(objective.teacher, generation, device, episodes)

    assert not wants(SCGRPO(), "auto") and wants(SCGRPO(), "rollout") and not wants(SCGRPO(), "forward")
    assert not wants(GRPO(), "rollout") and not wants(SCGRPO(), "rollout", episodes=True)

    def on_a_gpu(max_new_tokens, teacher="policy"):  # (only the device is a GPU's)
        return wants(SCGRPO(teacher=teacher), "auto", torch.device("cuda", 0), max_new_tokens=max_new_tokens)

    # the student's forward a pass of its own (long rows; a base teacher), or riding in the teacher's forward
    assert on_a_gpu(1024) and on_a_gpu(128, teacher="base") and not on_a_gpu(128)


def test_dynamic_sampling_rounds_and_selected_rows_keep_their_states():
    """DAPO's rounds are concatenated (completions right-padded: the states too) and filtered rows keep theirs; a
    round without states (another engine) leaves the whole batch without, so the student's forward runs."""
    from scgrpo.stage import concat_rollouts

    first, second = _rollouts([1.0, 0.0], [[5, 6], [7]], group_size=2), _rollouts([0.0, 1.0], [[8, 9, 10], [11]], group_size=2)
    first.student_states = torch.randn(2, first.completion_ids.shape[1], 4)
    second.student_states = torch.randn(2, second.completion_ids.shape[1], 4)
    merged = concat_rollouts([first, second], pad_id=2)
    c = merged.completion_ids.shape[1]
    assert merged.student_states.shape == (4, c, 4) and c > first.completion_ids.shape[1]
    assert torch.equal(merged.student_states[:2, : first.student_states.shape[1]], first.student_states)
    assert torch.equal(merged.student_states[2:], second.student_states)
    picked = merged.select(torch.tensor([3, 0]))
    assert torch.equal(picked.student_states, merged.student_states[[3, 0]])
    second.student_states = None
    assert concat_rollouts([first, second], pad_id=2).student_states is None
