"""Domain `terminal` (`env.TerminalEnvironment`): the task families (`tasks`) and the verifier copied into
a data-only sandbox (`verify`)."""
