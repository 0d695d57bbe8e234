"""rl.rollout: a real tiny engine and env pool (debug, terminal), turn logic, filters, batch golden values."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

import model
from configs import tiny
from envs import Task, registry
from envs.domains.terminal import tasks as terminal_tasks
from envs.pool import EnvPool
from inference import Completion, Engine, EngineConfig, SamplingParams
from model.io.tokenizer import ByteTokenizer
from rl import batch as batch_lib
from rl import grpo
from rl import rollout as ro

ECFG = EngineConfig(
    max_batch=4, max_seq_len=256, page_size=8, num_pages=128, prefill_chunk=64, prefill_batch=2, min_bucket=16
)
TOK = ByteTokenizer(256)  # no room for specials: eos (and pad) is byte 0
EOS = TOK.eos_id
SP = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
LOGP_TOL = 1e-5  # the engine's own bound between sampling log-probs and teacher-forced scores


@pytest.fixture(scope="module")
def pool():
    # forkserver workers start from a fresh interpreter, so the order relative to JAX does not matter;
    # started first anyway, as the trainer does.
    with EnvPool(2, domains=["debug", "terminal"], timeout_s=60.0) as p:
        yield p


@pytest.fixture(scope="module")
def engine(pool):
    cfg = tiny.get_config()
    return Engine(cfg, nnx.state(model.build(cfg, seed=0), nnx.Param), ECFG)


def _terminal_task(index: int, prompt: str = "Solve the shell task.") -> Task:
    """A level-0 terminal task with a short prompt (the real one is longer than the test engine's window);
    the environment reads only the metadata."""
    return dataclasses.replace(terminal_tasks.make_task(0, index, level=0), prompt=prompt)


def _check_aligned(s: ro.Sample) -> None:
    assert len(s.tokens) == len(s.mask) == len(s.behaviour_logp) == len(s.policy_versions)
    for m, lp, v in zip(s.mask, s.behaviour_logp, s.policy_versions):
        assert (m == 1 and lp <= 0.0 and v >= 0) or (m == 0 and lp == 0.0 and v == -1)
    assert s.num_generated == sum(s.mask)


def _segments(mask):
    """[(start, end, value)] runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


# --- prompts and observations ------------------------------------------------------------------------------


def test_format_prompt_and_observation_tokens():
    task = Task("t", "debug", "Reply with: ok")
    assert ro.format_prompt(task, TOK, chat=False) == TOK.encode("Reply with: ok\n")
    assert ro.format_prompt(task, TOK, chat=True) == TOK.encode("user: Reply with: ok\x00\nassistant: ")
    assert ro.observation_tokens(TOK, "out", chat=False, stop_token=EOS) == TOK.encode("\nout\n")
    # Chat: the template closes the assistant turn with "<eos>\n"; the model already wrote the eos.
    chat_obs = TOK.encode("\nuser: out\x00\nassistant: ")
    assert ro.observation_tokens(TOK, "out", chat=True, stop_token=EOS) == chat_obs
    assert ro.observation_tokens(TOK, "out", chat=True, stop_token=None) == [EOS, *chat_obs]


# --- real engine -------------------------------------------------------------------------------------------


def test_rollout_single_turn_real_engine(engine, pool):
    tasks = registry.make("debug").sample_tasks(0, 2)
    samples = ro.rollout(engine, pool, tasks, TOK, n=3, sampling=SP, group_offset=5)
    assert [(s.group, s.task.id) for s in samples] == [(5 + i // 3, tasks[i // 3].id) for i in range(6)]
    prompt = TOK.encode("Reply with: ok\n")
    debug = registry.make("debug")
    for s in samples:
        _check_aligned(s)
        assert s.prompt_tokens == prompt and s.turns == 1 and s.episode_done
        assert all(m == 1 for m in s.mask) and 1 <= len(s.tokens) <= SP.max_new_tokens
        assert (s.finish_reason == "stop") == (s.tokens[-1] == EOS)
        assert s.text == TOK.decode(s.tokens[:-1] if s.finish_reason == "stop" else s.tokens)
        expected = debug.score(s.task, s.text)
        assert (s.reward, s.status) == (expected.reward, expected.status)
        assert s.sandbox_seconds > 0
    sp = dataclasses.replace(SP, stop_tokens=(EOS,))
    scored = engine.score([s.prompt_tokens for s in samples], [s.tokens for s in samples], sp)
    for s, logp in zip(samples, scored):
        np.testing.assert_allclose(s.behaviour_logp, logp, atol=LOGP_TOL)

    batch, stats = batch_lib.make_batch(samples, length_bucket=16)
    for r, s in enumerate(samples):
        p, c = len(s.prompt_tokens), len(s.tokens)
        np.testing.assert_array_equal(batch["tokens_BT"][r, : p + c], s.prompt_tokens + s.tokens)
        np.testing.assert_array_equal(batch["mask_BT"][r], [0] * p + [1] * c + [0] * (32 - p - c))
        np.testing.assert_allclose(batch["behaviour_logp_BT"][r, p : p + c], s.behaviour_logp)
    assert batch["tokens_BT"].shape == (6, 32) and stats["samples/debug"] == 6


def test_rollout_multi_turn_real_engine(engine, pool):
    tasks = [_terminal_task(0), _terminal_task(1)]
    sp = dataclasses.replace(SP, max_new_tokens=8)
    samples = ro.rollout(engine, pool, tasks, TOK, n=2, sampling=sp, max_turns=2)
    assert len(samples) == 4
    sp = dataclasses.replace(sp, stop_tokens=(EOS,))
    for s in samples:
        _check_aligned(s)
        runs = _segments(s.mask)
        assert [v for _, _, v in runs] == ([1, 0, 1] if s.turns == 2 else [1])
        assert s.status in ("ok", "wrong") and not s.episode_done
        assert s.details["turns"] == s.turns  # the environment's count: no `submit` among random actions
        # The observation tokens show the environment's reply to the first action, which an independent
        # replay reproduces, unless the action put a job in the background (`&`): what such a job prints
        # before the shell exits is a race in the terminal environment, so only the tokens are checked.
        assert len(s.observations) == s.turns - 1
        if s.turns == 2:
            first = s.tokens[: runs[0][1]]
            stop = EOS if first[-1] == EOS else None
            obs = ro.observation_tokens(TOK, s.observations[0], chat=False, stop_token=stop)
            assert s.tokens[runs[1][0] : runs[1][1]] == obs
            [(episode, _)] = pool.run_episodes([(s.task, s.actions[:1])])
            assert "&" in s.actions[0] or episode["observation"] == s.observations[0]
    # Each model segment's log-probs are the engine's teacher-forced ones given everything before it
    # (one scoring call for all segments: fewer shapes to compile).
    segments = [(s, a, b) for s in samples for a, b, v in _segments(s.mask) if v == 1]
    contexts = [s.prompt_tokens + s.tokens[:a] for s, a, _ in segments]
    scored = engine.score(contexts, [s.tokens[a:b] for s, a, b in segments], sp)
    for (s, a, b), logp in zip(segments, scored):
        np.testing.assert_allclose(s.behaviour_logp[a:b], logp, atol=LOGP_TOL)
    assert any(s.turns == 2 for s in samples)


# --- turn logic with a stand-in engine ----------------------------------------------------------------------


class ScriptedEngine:
    """Stands in for `inference.Engine`: answers each context with the next action of a script chosen by
    the prompt's text (a task's whole prompt), counting the turns already taken in the context."""

    def __init__(self, scripts: dict[str, list[list[str]]], version: int = 7):
        self.scripts, self.version, self.calls = scripts, version, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text = TOK.decode(prompt)
            key = next(k for k in self.scripts if k in text)
            if text.startswith("user: "):  # chat: one assistant header per turn taken, plus the open one
                turn = text.count("assistant: ") - 1
            else:
                turn = prompt[len(ro.format_prompt(Task("", "", key), TOK, chat=False)) :].count(EOS)
            for j in range(p.n):
                actions = self.scripts[key][j % len(self.scripts[key])]
                tokens = [*TOK.encode(actions[min(turn, len(actions) - 1)]), EOS][: p.max_new_tokens]
                reason = "stop" if tokens[-1] == EOS else "length"
                lp = [-0.25] * len(tokens)
                out.append(Completion(i, tokens, lp, reason, j, lp, [self.version] * len(tokens), i))
        return out


@pytest.mark.parametrize("chat", [False, True])
def test_multi_turn_turn_logic_with_reference_actions(pool, chat):
    task = _terminal_task(0, prompt="TASK0")
    actions = registry.make("terminal").reference_solution(task).splitlines()
    assert actions[-1] == "submit" and len(actions) >= 2
    engine = ScriptedEngine({"TASK0": [actions]})
    sp = dataclasses.replace(SP, max_new_tokens=200)  # room for the longest reference action
    [s] = ro.rollout(engine, pool, [task], TOK, n=1, sampling=sp, max_turns=10, chat=chat)
    assert (s.reward, s.status, s.episode_done) == (1.0, "ok", True)
    assert s.turns == len(actions) and s.actions == actions and s.text == "\n".join(actions)
    assert s.details["turns"] == len(actions) - 1  # the environment does not count `submit` as a step
    assert engine.calls == [1] * len(actions)
    # Expected tokens: each action + eos, then (except after the last) the observation the env gives.
    env = registry.make("terminal")
    episode, expected, mask = env.reset(task), [], []
    for k, action in enumerate(actions):
        expected += [*TOK.encode(action), EOS]
        mask += [1] * (len(TOK.encode(action)) + 1)
        episode = env.step(episode, action)
        if k < len(actions) - 1:
            obs = ro.observation_tokens(TOK, episode.observation, chat=chat, stop_token=EOS)
            expected += obs
            mask += [0] * len(obs)
    env.close()
    assert s.tokens == expected and s.mask == mask and len(s.observations) == len(actions) - 1
    _check_aligned(s)
    assert {v for v, m in zip(s.policy_versions, s.mask) if m} == {7}
    # Stopping early: the rollout's turn limit, then a token budget too small for the first observation.
    [short] = ro.rollout(engine, pool, [task], TOK, n=1, sampling=sp, max_turns=2, chat=chat)
    assert short.turns == 2 and not short.episode_done and short.mask[-1] == 1
    assert short.tokens == expected[: len(short.tokens)]
    first = len(TOK.encode(actions[0])) + 1
    budget = len(ro.format_prompt(task, TOK, chat=chat)) + first + 5
    [tight] = ro.rollout(
        engine, pool, [task], TOK, n=1, sampling=sp, max_turns=10, max_total_tokens=budget, chat=chat
    )
    assert tight.turns == 1 and not tight.episode_done and tight.tokens == expected[:first]


# --- filters ------------------------------------------------------------------------------------------------


def _sample(group, reward, status="ok", tokens=(1,), mask=None, logp=None, prompt=(9,), domain="debug"):
    tokens = list(tokens)
    mask = [1] * len(tokens) if mask is None else list(mask)
    logp = [-0.5 * m for m in mask] if logp is None else list(logp)
    versions = [0 if m else -1 for m in mask]
    task = Task(f"task-{group}", domain, "p")
    return ro.Sample(task, group, list(prompt), tokens, mask, logp, versions, reward, status, "stop", "x")


def test_filter_samples_counts_and_keeps():
    samples = [
        *[_sample(0, r) for r in (1.0, 0.0, 1.0)],  # binary, varies: kept
        *[_sample(1, 1.0) for _ in range(3)],  # binary, constant: dropped
        *[_sample(2, r) for r in (0.5, 0.5 + 1e-8, 0.5)],  # float, within reward_tol: dropped
        *[_sample(3, r) for r in (0.5, 0.6)],  # float, varies: kept
        _sample(4, 1.0),
        _sample(4, 0.0, "crash"),
        _sample(4, 0.0, "env_error"),  # one left: dropped
        _sample(5, 1.0),
        _sample(5, 0.0, "format_error"),
        _sample(5, 0.0, "timeout"),  # two left, and they vary: kept
        *[_sample(6, 0.0, "wrong"), _sample(6, 0.0, "timeout"), _sample(6, 0.0)],  # two 0s: zero variance
    ]
    kept, counts = ro.filter_samples(samples, group_size=3)
    assert [(s.group, s.reward) for s in kept] == [
        (0, 1.0), (0, 0.0), (0, 1.0), (3, 0.5), (3, 0.6), (5, 1.0), (5, 0.0)
    ]  # fmt: skip
    assert all(s.status not in ro.EXCLUDED_STATUSES for s in kept)
    assert counts == {
        "groups_in": 7,
        "samples_in": 20,
        "excluded_crash": 1,
        "excluded_env_error": 1,
        "excluded_timeout": 2,
        "dropped_small_groups": 1,
        "dropped_small_group_samples": 1,
        "dropped_zero_variance_groups": 3,
        "dropped_zero_variance_samples": 8,
        "kept_groups": 3,
        "kept_samples": 7,
    }
    # Binary rewards are compared exactly whatever the tolerance; floats within it.
    kept, counts = ro.filter_samples(samples, reward_tol=0.5)
    assert sorted({s.group for s in kept}) == [0, 5] and counts["dropped_zero_variance_groups"] == 4
    with pytest.raises(ValueError, match="more than group_size"):
        ro.filter_samples(samples, group_size=2)


# --- batch --------------------------------------------------------------------------------------------------


def _ragged():
    return [
        _sample(10, 1.0, tokens=[7, 8, 9], mask=[1, 0, 1], logp=[-0.1, 0.0, -0.3], prompt=[5, 6]),
        _sample(10, 0.0, tokens=[4], logp=[-0.4], prompt=[5, 6]),
        _sample(11, 0.0, tokens=[1, 2], logp=[-1.0, -2.0], prompt=[3], domain="math"),
        _sample(11, 0.5, tokens=[1], logp=[-1.5], prompt=[3], domain="math"),
        _sample(11, 1.0, tokens=[2, 2, 2, 2], logp=[-0.5] * 4, prompt=[3], domain="math"),
    ]


def test_make_batch_golden_ragged():
    batch, stats = batch_lib.make_batch(_ragged(), length_bucket=4, row_multiple=4)
    # Rows: 5 of lengths 5, 3, 3, 2, 5 -> T = 8 (bucket 4); 5 rows padded to 8 (row_multiple 4).
    np.testing.assert_array_equal(
        batch["tokens_BT"][:5],
        [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 4, 0, 0, 0, 0, 0], [3, 1, 2, 0, 0, 0, 0, 0],
         [3, 1, 0, 0, 0, 0, 0, 0], [3, 2, 2, 2, 2, 0, 0, 0]],
    )  # fmt: skip
    np.testing.assert_array_equal(
        batch["mask_BT"][:5],
        [[0, 0, 1, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0],
         [0, 1, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]],
    )  # fmt: skip
    np.testing.assert_allclose(batch["behaviour_logp_BT"][0], [0, 0, -0.1, 0, -0.3, 0, 0, 0])
    np.testing.assert_allclose(batch["behaviour_logp_BT"][2], [0, -1.0, -2.0, 0, 0, 0, 0, 0])
    assert batch["tokens_BT"].shape == (8, 8) and not batch["mask_BT"][5:].any()
    assert batch["tokens_BT"].dtype == np.int32 and batch["mask_BT"].dtype == np.float32
    np.testing.assert_array_equal(batch["positions_BT"], np.tile(np.arange(8), (8, 1)))
    # Advantages by hand, eps 1e-6. Group 10: rewards (1, 0), mean .5, std .5 -> +-.5 / (.5 + 1e-6).
    # Group 11: (0, .5, 1), mean .5, std sqrt(1/6) = .4082483 -> (-1.2247419, 0, 1.2247419).
    g10 = 0.5 / (0.5 + 1e-6)
    g11 = 0.5 / (np.sqrt(1 / 6) + 1e-6)
    np.testing.assert_allclose(batch["advantages_B"], [g10, -g10, -g11, 0, g11, 0, 0, 0], rtol=1e-6)
    # "none": centred only. "batch": centred per group over the std of all five rewards (1, 0, 0, .5, 1):
    # mean .5, squared deviations .25 * 4 -> var .2, std .4472136 -> +-.5 / .4472136 = +-1.1180340.
    none = batch_lib.make_batch(_ragged(), adv_std="none", length_bucket=4)[0]["advantages_B"]
    np.testing.assert_allclose(none, [0.5, -0.5, -0.5, 0, 0.5], atol=1e-7)
    over_batch = batch_lib.make_batch(_ragged(), adv_std="batch", length_bucket=4)[0]["advantages_B"]
    b = 0.5 / (np.sqrt(0.2) + 1e-6)
    np.testing.assert_allclose(over_batch, [b, -b, -b, 0, b], rtol=1e-6)
    assert stats["trained_tokens"] == 2 + 1 + 2 + 1 + 4 and stats["truncated_rows"] == 0
    assert stats["reward_mean/debug"] == 0.5 and stats["reward_mean/math"] == 0.5
    assert stats["samples/math"] == 3 and stats["seq_len"] == 8 and stats["rows"] == 8


def test_make_batch_truncation_and_equal_groups():
    batch, stats = batch_lib.make_batch(_ragged(), length_bucket=4, max_len=4)
    # Rows longer than 4 keep their first 4 tokens; mask and log-probs are cut alike.
    np.testing.assert_array_equal(batch["tokens_BT"][0], [5, 6, 7, 8])
    np.testing.assert_array_equal(batch["mask_BT"][0], [0, 0, 1, 0])
    np.testing.assert_array_equal(batch["mask_BT"][4], [0, 1, 1, 1])
    assert batch["tokens_BT"].shape == (5, 4) and stats["truncated_rows"] == 2
    with pytest.raises(ValueError, match="no completion token"):
        batch_lib.make_batch(_ragged(), max_len=2)
    # Equal groups: the same as rl.grpo.group_advantages on the whole batch, for every variant.
    rewards = [1.0, 0.0, 0.0, 0.25, 0.5, 1.0]
    samples = [_sample(i // 3, r) for i, r in enumerate(rewards)]
    for std in ("group", "batch", "none"):
        expected = grpo.group_advantages(np.asarray(rewards, np.float32), 3, std=std)
        got = batch_lib.make_batch(samples, adv_std=std)[0]["advantages_B"]
        np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-6, atol=1e-7)


def test_make_batch_refuses_rows_longer_than_the_logit_window():
    # The longest completions in _ragged() are 4 tokens (rows 0 and 4 hold 3 and 4): a window of 4 fits.
    batch, _ = batch_lib.make_batch(_ragged(), length_bucket=4, window=4)
    assert batch["tokens_BT"].shape == (5, 8)
    with pytest.raises(ValueError, match=r"4 tokens after its prompt.*logit window of 3.*rl\.max_new_tokens"):
        batch_lib.make_batch(_ragged(), length_bucket=4, window=3)


# --- back-fill ----------------------------------------------------------------------------------------------


def test_collect_back_fills_until_enough_groups(pool):
    # Debug tasks whose prompt picks the scripted completions: MIXED varies (valid), SAME does not, RAISE
    # makes the environment raise (env_error on every sample: the group is excluded).
    scripts = {"MIXED": [["ok"], ["wrong"]], "SAME": [["ok"]], "RAISE": [["raise"]]}
    rounds = [["SAME", "MIXED", "RAISE"], ["MIXED", "SAME"], ["MIXED"]]
    asked = []

    def next_tasks(k):
        asked.append(k)
        names = rounds[len(asked) - 1]
        return [Task(f"{name}-{len(asked)}", "debug", name) for name in names]

    kw = dict(groups=3, n=2, sampling=SP)
    samples, counts, drawn, _ = ro.collect(ScriptedEngine(scripts), pool, next_tasks, TOK, **kw)
    assert asked == [3, 2, 1]
    assert counts["rounds"] == 3 and counts["groups_collected"] == 3 and counts["groups_missing"] == 0
    assert counts["dropped_zero_variance_groups"] == 2 and counts["excluded_env_error"] == 2
    assert counts["dropped_small_groups"] == 1 and counts["surplus_groups"] == 0
    assert [s.task.id for s in samples[::2]] == ["MIXED-1", "MIXED-2", "MIXED-3"]
    assert len({s.group for s in samples}) == 3 and [s.reward for s in samples] == [1.0, 0.0] * 3
    # The curriculum's view counts every sample drawn: 6 + 4 + 2 over the three rounds.
    assert drawn["debug"].samples == 12
    # Out of attempts: returns what it has and says so.
    asked.clear()
    samples, counts, _, _ = ro.collect(ScriptedEngine(scripts), pool, next_tasks, TOK, max_attempts=2, **kw)
    assert asked == [3, 2] and counts["rounds"] == 2
    assert counts["groups_collected"] == 2 and counts["groups_missing"] == 1 and len(samples) == 4


def test_collect_real_engine_gives_up(engine, pool):
    """A random tiny model never writes `ok` or `wrong`: every group is format_error, zero variance."""
    debug = registry.make("debug")
    rounds = []

    def next_tasks(k):
        rounds.append(k)
        return debug.sample_tasks(len(rounds), k)

    samples, counts, drawn, _ = ro.collect(
        engine, pool, next_tasks, TOK, groups=2, n=2, sampling=SP, max_attempts=2
    )
    assert samples == [] and rounds == [2, 2]
    assert counts["rounds"] == 2 and counts["groups_missing"] == 2
    assert counts["dropped_zero_variance_groups"] == 4
    assert drawn["debug"].samples == 8 and drawn["debug"].reward_sum == 0.0
