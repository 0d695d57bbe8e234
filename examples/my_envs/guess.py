"""A multi-turn environment: find a hidden number; each guess is answered "higher", "lower" or "correct"
("number?" to anything else).

The prompt gives the range ("guess 12-19"), eight numbers at level 0 and sixteen at level 1, so a binary
search (the reference solution) needs at most 4 or 5 guesses. Reward 1.0 (`ok`) for finding the number
within the turns; else `wrong`, or `format_error` when some guess was not a number.
"""

from envs import Environment, Episode, Score


class GuessNumber(Environment):
    levels = (0, 1)
    max_turns = 5

    def make_task(self, rng, level):
        low = rng.randrange(90)
        high = low + 8 * 2**level - 1
        return f"guess {low}-{high}", {"low": low, "high": high, "secret": rng.randint(low, high)}

    def reset(self, task):
        return Episode(task=task, observation=task.prompt)

    def step(self, episode, action):
        guess, secret = action.strip(), episode.task.metadata["secret"]
        if len(guess) > 4 or not guess.isdigit():
            reply = "number?"
        else:
            reply = "correct" if int(guess) == secret else "higher" if int(guess) < secret else "lower"
        episode.transcript.append({"action": action, "observation": reply})
        episode.observation, episode.turns = reply, episode.turns + 1
        episode.done = reply == "correct" or episode.turns >= self.max_turns
        return episode

    def score_episode(self, task, episode):
        replies = [turn["observation"] for turn in episode.transcript]
        if "correct" in replies:
            return Score(1.0, "ok", {"turns": episode.turns})
        if not replies or "number?" in replies:
            return Score(0.0, "format_error", {"turns": episode.turns})
        return Score(0.0, "wrong", {"turns": episode.turns, "secret": task.metadata["secret"]})

    def reference_solution(self, task):  # a binary search: the guesses, one per line
        low, high, secret = task.metadata["low"], task.metadata["high"], task.metadata["secret"]
        guesses = []
        while not guesses or guesses[-1] != secret:
            guesses.append((low + high) // 2)
            low, high = (guesses[-1] + 1, high) if guesses[-1] < secret else (low, guesses[-1] - 1)
        return "\n".join(map(str, guesses))
