"""GRPO trainer, rollout pipeline and domain curriculum (issue 6)."""
