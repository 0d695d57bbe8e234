"""Domain `finance` (`env.FinanceEnvironment`): companies (`company`), their documents (`documents`) and
questions across them (`questions`)."""
