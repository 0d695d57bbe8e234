"""Examples that use the project as a user would: importable from the repository root (`examples.*`), not
installed with the project's packages."""
