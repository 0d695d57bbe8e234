"""The benchmarks: one module per benchmark, run through one runner (`python -m benchmarks NAME [flags]`,
benchmarks/__main__.py), each writing JSON lines with the header of `benchmarks.record`. Raw lines behind
the README's figures are in benchmarks/results/."""
