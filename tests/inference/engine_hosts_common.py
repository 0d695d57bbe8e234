"""What tests/inference/test_engine_hosts.py and its child processes share: the config, the prompts, the
sampling."""

from configs import grpo
from inference.sampling import SamplingParams

SEED = 0
PROMPTS = [[5, 17, 3, 99, 4], [7, 7, 8, 1, 200, 31, 2, 9, 11], list(range(40, 60))]
# Each fits one page (16 tokens) and grows into a second: 3 of them overfill a pool of 3 usable pages.
CROWD = [list(range(1, 11)), list(range(30, 42)), list(range(60, 74))]
NEW_TOKENS = 8


def config(**mesh):
    cfg = grpo.get_config("test")
    cfg.mesh.shape.update({"data": 1, **mesh})
    return cfg


def run(engine, prompts=PROMPTS) -> dict:
    """Greedy tokens and the log-probs of T=1 samples (seeded) on `prompts`."""
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    sampled = engine.generate(
        prompts, [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=11 + i) for i in range(3)]
    )
    return {
        "greedy": [c.tokens for c in greedy],
        "sampled": [c.tokens for c in sampled],
        "logprobs": [c.logprobs for c in sampled],
    }
