"""rl.data: deterministic per-record tasks, exact resume from grain state, held-out eval split, mixing."""

import json

import pytest

from envs.domains import math_env
from rl import data
from rl.data import DomainTasks, TaskMixer, split_of

# Disjointness sample per domain: finance eval tasks cost ~50 ms each (1/holdout redraws of ~6 ms).
SAMPLE = {"math": 300, "code": 300, "scene3d": 300, "finance": 80}


def _ids(tasks):
    return [t.id for t in tasks]


def test_same_arguments_same_tasks():
    a, b = DomainTasks("math", seed=3), DomainTasks("math", seed=3)
    tasks = a.next_tasks(20)
    assert _ids(tasks) == _ids(b.next_tasks(20))
    assert [t.to_json() for t in tasks] == [t.to_json() for t in DomainTasks("math", seed=3).next_tasks(20)]
    assert _ids(tasks) != _ids(DomainTasks("math", seed=4).next_tasks(20))
    assert len(set(_ids(tasks))) == 20


@pytest.mark.parametrize("consumed", [0, 7, 13])
def test_resume_yields_the_same_tasks(consumed):
    # 5 records, so 13 consumed crosses two epoch boundaries (grain reshuffles each epoch).
    uninterrupted = DomainTasks("scene3d", seed=1, num_records=5)
    expected = _ids(uninterrupted.next_tasks(consumed + 9))[consumed:]

    first = DomainTasks("scene3d", seed=1, num_records=5)
    first.next_tasks(consumed)
    state = json.loads(json.dumps(first.get_state()))  # what the checkpoint stores
    resumed = DomainTasks("scene3d", seed=1, num_records=5)
    resumed.next_tasks(2)  # a fresh process may have read ahead: the state overrides it
    resumed.set_state(state)
    assert _ids(resumed.next_tasks(9)) == expected


def test_epochs_visit_every_record_once():
    stream = DomainTasks("math", seed=0, num_records=6, num_epochs=2)
    tasks = stream.next_tasks(20)
    assert len(tasks) == 12
    first, second = _ids(tasks[:6]), _ids(tasks[6:])
    assert sorted(first) == sorted(second) and len(set(first)) == 6
    assert first != second  # reshuffled
    assert stream.next_tasks(3) == []


@pytest.mark.parametrize("domain", sorted(SAMPLE))
def test_train_selection_and_eval_prompts_are_disjoint(domain):
    n = SAMPLE[domain]
    prompts = {}
    for split in data.SPLITS:
        tasks = DomainTasks(domain, seed=0, split=split).next_tasks(n if split != "selection" else n // 2)
        # The defaults: eval is the hash's [0, 1/8), selection [1/8, 1/4), train the rest.
        assert {split_of(t, holdout=0.125, selection=0.125) for t in tasks} == {split}
        prompts[split] = {t.prompt for t in tasks}
    for a, b in (("train", "eval"), ("train", "selection"), ("selection", "eval")):
        assert not prompts[a] & prompts[b], (a, b)
    # The split belongs to the prompt, not to the stream's seed: eval of another run seed is held out too.
    other = DomainTasks(domain, seed=1, split="eval").next_tasks(n // 4)
    assert not prompts["train"] & {t.prompt for t in other}


def test_selection_zero_keeps_the_two_split_assignment():
    # With no selection fraction a prompt's split is what the two-split scheme gave it: eval below holdout.
    tasks = math_env.MathEnvironment().sample_tasks(5, 200)
    u = lambda t: data._hash64("split", t.prompt) / 2.0**64
    assert [split_of(t, holdout=0.3) for t in tasks] == ["eval" if u(t) < 0.3 else "train" for t in tasks]
    with pytest.raises(ValueError, match="rl.data.selection"):
        DomainTasks("math", seed=0, split="selection", selection=0.0)
    with pytest.raises(ValueError, match="rl.data.selection"):
        DomainTasks("math", seed=0, holdout=0.5, selection=0.5)
    with pytest.raises(ValueError, match="rl.data.holdout"):
        DomainTasks("math", seed=0, holdout=0.0)


def test_disjoint_env_seeds():
    # math task ids are "math/<env seed>/<index>/L<level>": train seeds are even, eval seeds 1 mod 4,
    # selection seeds 3 mod 4.
    expected = {"train": {0, 2}, "eval": {1}, "selection": {3}}
    for split in data.SPLITS:
        tasks = DomainTasks("math", seed=0, split=split).next_tasks(50)
        assert {int(t.id.split("/")[1]) % 4 for t in tasks} <= expected[split]


def test_terminal_small_template_pool():
    # ~30 prompt templates over per-task files: the default splits on the whole task (prompt + metadata),
    # keeping every level in both splits. split_on="prompt" forces disjoint prompts, and then a level whose
    # few templates all hash to train has no eval tasks (measured: levels 2 and 3 with holdout 1/8).
    train = DomainTasks("terminal", seed=0).next_tasks(200)
    held_out = DomainTasks("terminal", seed=0, split="eval").next_tasks(200)
    key = lambda t: json.dumps([t.prompt, t.metadata], sort_keys=True)
    assert not {key(t) for t in train} & {key(t) for t in held_out}
    assert {t.difficulty for t in train} == {t.difficulty for t in held_out} == {0, 1, 2, 3}
    # (Two splits here, selection=0: with a selection eighth too, level 0's few templates all hash out of
    # train, measured, which is the same price one level over.)
    strict = lambda split, level: DomainTasks(
        "terminal", seed=0, split=split, split_on="prompt", difficulty=level, selection=0.0
    ).next_tasks(50)
    for level in (0, 1):
        assert not {t.prompt for t in strict("train", level)} & {t.prompt for t in strict("eval", level)}
    with pytest.raises(RuntimeError, match="pool is too small"):
        strict("eval", 3)


def test_single_prompt_pool_fails_loudly():
    # The debug domain has one prompt: it belongs to one split, and the other split cannot exist.
    splits = {s: DomainTasks("debug", seed=0, split=s, split_on="prompt") for s in data.SPLITS}
    owner = split_of(splits["train"].env.sample_tasks(0, 1)[0], holdout=0.125, selection=0.125)
    assert len(splits[owner].next_tasks(3)) == 3
    for empty in set(data.SPLITS) - {owner}:
        with pytest.raises(RuntimeError, match="pool is too small"):
            splits[empty].next_tasks(1)


@pytest.mark.parametrize("level", [0, 3])
def test_difficulty(level):
    tasks = DomainTasks("math", seed=0, difficulty=level).next_tasks(10)
    assert {t.difficulty for t in tasks} == {level}
    with pytest.raises(ValueError, match="difficulty=7"):
        DomainTasks("math", seed=0, difficulty=7)


def test_levels_are_mixed_without_difficulty():
    tasks = DomainTasks("scene3d", seed=0).next_tasks(80)  # scene3d alone would give level 0 for n=1
    assert {t.difficulty for t in tasks} == {0, 1, 2, 3}


def test_data_backed_math_environment():
    pool = [math_env.generate_task(99, i, 1) for i in range(40)]
    env = math_env.MathEnvironment(tasks=pool)
    train = DomainTasks("math", seed=0, env=env).next_tasks(30)
    assert {t.prompt for t in train} <= {t.prompt for t in pool}


def test_state_of_another_stream_is_rejected():
    state = DomainTasks("math", seed=0).get_state()
    with pytest.raises(ValueError, match="seed"):
        DomainTasks("math", seed=1).set_state(state)


def test_mixer_allocation_and_resume():
    make = lambda: TaskMixer({d: DomainTasks(d, seed=0) for d in ("math", "scene3d")})
    mixer = make()
    tasks = mixer.next_tasks({"scene3d": 2, "math": 3})
    assert [t.domain for t in tasks] == ["scene3d"] * 2 + ["math"] * 3
    state = json.loads(json.dumps(mixer.get_state()))
    expected = _ids(mixer.next_tasks({"math": 4, "scene3d": 1}))
    resumed = make()
    resumed.set_state(state)
    assert _ids(resumed.next_tasks({"math": 4, "scene3d": 1})) == expected
    assert mixer.next_tasks({"math": 0}) == []
    with pytest.raises(KeyError, match="code"):
        mixer.next_tasks({"code": 1})
    with pytest.raises(ValueError, match="domains"):
        resumed.set_state({"math": state["math"]})


# ---------------------------------------------------------------------------------------------------------
# Split data (GSM8K train / test), environment options, resume identity
# ---------------------------------------------------------------------------------------------------------


def _write_gsm8k(path, questions):
    lines = [json.dumps({"question": q, "answer": f"x\n#### {i}"}) + "\n" for i, q in enumerate(questions)]
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture
def gsm8k_files(tmp_path):
    train = [f"Train question {i}?" for i in range(16)]
    test = [f"Test question {i}?" for i in range(4)]
    kwargs = {"train_jsonl": _write_gsm8k(tmp_path / "train.jsonl", train)}
    kwargs["test_jsonl"] = _write_gsm8k(tmp_path / "test.jsonl", test)
    # The data's train split holds the train and selection splits, told apart by the prompt hash alone.
    env = math_env.MathEnvironment(**kwargs)
    by_hash = {q: split_of(t, holdout=0.0, selection=0.125) for q, t in zip(train, env.split_tasks["train"])}
    selection = {q for q, split in by_hash.items() if split == "selection"}
    assert selection and selection != set(train)  # both non-empty for these 16 questions
    return kwargs, {"train": set(train) - selection, "selection": selection, "eval": set(test)}


def _question(task):
    return task.prompt.split("\n\n")[0]


def test_split_data_streams_draw_from_their_own_file(gsm8k_files):
    kwargs, questions = gsm8k_files
    for split in data.SPLITS:
        stream = DomainTasks("math", seed=0, split=split, env_kwargs=kwargs)
        assert stream.data_split == data.DATA_SPLIT[split]
        # All of the split's records, and nothing else: no hash holdout inside split data's test split.
        assert {_question(t) for t in stream.next_tasks(120)} == questions[split]


def test_env_and_env_kwargs_are_exclusive(gsm8k_files):
    with pytest.raises(ValueError, match="not both"):
        DomainTasks("math", seed=0, env=math_env.MathEnvironment(), env_kwargs=gsm8k_files[0])


def test_resume_under_other_data_is_refused(gsm8k_files, tmp_path):
    kwargs, _ = gsm8k_files
    stream = DomainTasks("math", seed=0, env_kwargs=kwargs)
    stream.next_tasks(3)
    state = json.loads(json.dumps(stream.get_state()))
    expected = _ids(stream.next_tasks(5))
    resumed = DomainTasks("math", seed=0, env_kwargs=dict(kwargs))
    resumed.set_state(state)
    assert _ids(resumed.next_tasks(5)) == expected
    other = dict(kwargs, train_jsonl=_write_gsm8k(tmp_path / "other.jsonl", ["Another question?"] * 16))
    with pytest.raises(ValueError, match="tasks differ"):
        DomainTasks("math", seed=0, env_kwargs=other).set_state(state)
    with pytest.raises(ValueError, match="tasks differ"):  # unsplit data is another stream too
        DomainTasks("math", seed=0).set_state(state)
    legacy = {k: v for k, v in state.items() if k != "tasks"}  # states saved before the digest existed
    DomainTasks("math", seed=0, env_kwargs=kwargs).set_state(legacy)


def test_scoring_options_do_not_change_the_stream():
    # code's reward rule and timeouts change scoring only: a resume under them is no other stream.
    state = DomainTasks("code", seed=0).get_state()
    DomainTasks("code", seed=0, env_kwargs={"reward": "fraction", "test_timeout_s": 2.0}).set_state(state)


# ---------------------------------------------------------------------------------------------------------
# Held-out selection shared by rl.train and rl.evaluate
# ---------------------------------------------------------------------------------------------------------


def _cfg(**rl):
    import ml_collections

    base = {"domains": ("arith", "strings"), "seed": 0, "chat": False, "max_prompt_len": 11}
    base["eval"] = {"n_tasks": 6, "k": 2}
    return ml_collections.ConfigDict({"rl": {**base, **rl}})


def test_heldout_tasks_respect_levels_and_prompt_length():
    from model.io.tokenizer import ByteTokenizer
    from rl import rollout

    tokenizer = ByteTokenizer(256)
    # strings prompts: level 1 takes 10-11 tokens, level 3 takes 12-13: only level 1 fits 11.
    cfg = _cfg(levels={"strings": (1, 3)})
    heldout = data.heldout_tasks(cfg, tokenizer)
    assert sorted(heldout) == ["arith", "strings"]
    for tasks in heldout.values():
        assert len(tasks) == 6 and len({t.id for t in tasks}) == 6
        assert all(len(rollout.format_prompt(t, tokenizer, chat=False)) <= 11 for t in tasks)
    assert {t.difficulty for t in heldout["strings"]} == {1}
    assert {t.difficulty for t in heldout["arith"]} > {0}  # no levels given: all levels
    # They are the first fitting tasks of the eval stream, the same in every call (trainer and rl.evaluate).
    stream = DomainTasks("strings", seed=0, split="eval", levels=(1, 3))
    first = [t for t in stream.next_tasks(40) if data.fits_prompt(t, tokenizer, cfg)][:6]
    assert _ids(first) == _ids(heldout["strings"])
    assert data.heldout_tasks(cfg, tokenizer) == heldout
    with pytest.raises(ValueError, match=r"rl.max_prompt_len=8"):
        data.heldout_tasks(_cfg(max_prompt_len=8), tokenizer)


def test_heldout_tasks_use_the_env_options(gsm8k_files):
    import ml_collections

    from model.io.tokenizer import ByteTokenizer

    kwargs, questions = gsm8k_files
    cfg = _cfg(domains=("math",), max_prompt_len=512, env=ml_collections.ConfigDict({"math": kwargs}))
    cfg.rl.eval.n_tasks = 4
    heldout = data.heldout_tasks(cfg, ByteTokenizer(256))["math"]
    assert {_question(t) for t in heldout} == questions["eval"]  # all 4 test records, each once
    cfg.rl.eval.n_tasks = 5
    with pytest.raises(ValueError, match="only 4 distinct"):
        data.heldout_tasks(cfg, ByteTokenizer(256))


def test_heldout_prompts_are_distinct_and_selection_is_apart():
    from model.io.tokenizer import ByteTokenizer

    # arith level 0 has 10 * 10 * 2 = 200 expressions (fewer prompts: a - b with a < b is swapped), so 40
    # draws of its eval stream repeat prompts; the held-out tasks keep each prompt once.
    tokenizer = ByteTokenizer(256)
    cfg = _cfg(domains=("arith",), levels={"arith": (0,)}, max_prompt_len=16)
    cfg.rl.eval.n_tasks = 12
    drawn = DomainTasks("arith", seed=0, split="eval", difficulty=0).next_tasks(60)
    assert data.distinct_prompts(drawn) < len(drawn)  # the stream itself repeats prompts
    heldout = data.heldout_tasks(cfg, tokenizer)["arith"]
    assert len(heldout) == data.distinct_prompts(heldout) == 12
    selection = data.selection_tasks(cfg, tokenizer)["arith"]
    assert len(selection) == data.distinct_prompts(selection) == 12
    assert not {t.prompt for t in heldout} & {t.prompt for t in selection}
    assert {split_of(t, holdout=0.125, selection=0.125) for t in selection} == {"selection"}
    # The fractions come from rl.data; bad ones are refused naming the field.
    cfg.rl.data = {"holdout": 0.25, "selection": 0.25}
    assert {
        split_of(t, holdout=0.25, selection=0.25) for t in data.selection_tasks(cfg, tokenizer)["arith"]
    } == {"selection"}
    cfg.rl.data = {"holdout": 0.5, "selection": 0.5}
    with pytest.raises(ValueError, match="rl.data.selection"):
        data.heldout_tasks(cfg, tokenizer)
