"""Domain `code` (`env.CodeEnvironment`): a problem bank (`problems`), the runner copied into the sandbox
(`runner`) and the scoring of its report (`scoring`)."""
