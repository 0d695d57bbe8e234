"""python -m benchmarks peer_table [--write README.md]

The README's table of speed beside the peers, built from the committed raw lines of one session's runs:
`benchmarks/results/grpo_step.jsonl` (`benchmarks/grpo_step.py --tunix_python=...`) and
`benchmarks/results/decode_peer.jsonl` (`benchmarks/decode.py --sections=peer,speculative --hf_python=...
--tunix_python=...`). Prints the table; `--write README.md` replaces the lines between the README's
`<!-- peer table -->` markers with it (tests/benchmarks/test_peer_table.py checks that the two agree).
"""

from __future__ import annotations

import argparse
import json
import os
from statistics import median

from configs import schema

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BEGIN, END = "<!-- peer table -->", "<!-- /peer table -->"
ARCHS = (("qwen3moe", "MoE"), ("qwen3", "dense"))
PHASES = ("generate", "reference_logprobs", "train", "weight_sync")


def _lines(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


def _by(lines: list[dict], bench: str) -> dict[str, dict]:
    return {line["arch"]: line for line in lines if line.get("bench") == bench}


def _runs(lines: list[dict], bench: str) -> dict[str, list[dict]]:
    """Per arch, the `bench` lines of every run in the file, in order."""
    out: dict[str, list[dict]] = {}
    for line in lines:
        if line.get("bench") == bench:
            out.setdefault(line["arch"], []).append(line)
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table() -> str:
    grpo = _lines("grpo_step.jsonl")
    ours, tunix, compare = (_runs(grpo, b) for b in ("grpo_step", "grpo_step_tunix", "grpo_step_compare"))
    decode = _lines("decode_peer.jsonl")
    peer, peer_runs = _by(decode, "decode_peer"), _runs(decode, "decode_peer")
    runs = len(compare[ARCHS[0][0]])
    rows = [
        f"| figure (median after the first step or call; GRPO: median of {runs} runs) | ours | Tunix 0.1.7 |"
        " transformers | ours / peer (each run) |",
        "|---|---|---|---|---|",
    ]
    for arch, label in ARCHS:
        o, t, c = ours[arch], tunix[arch], compare[arch]
        each = ", ".join(f"{x['step_ratio_tunix_over_ours']:.2f}" for x in c)
        rows.append(
            f"| one GRPO step, 4 prompts x 4 samples, 32 + 64 tokens, KL 0.04, {label} |"
            f" {median([x['step_s_median'] for x in o]):.2f} s |"
            f" {median([x['step_s_median'] for x in t]):.2f} s | - |"
            f" {_ratio(median([x['step_ratio_tunix_over_ours'] for x in c]))} ({each}) |"
        )
    for arch, label in ARCHS:
        o, t, c = ours[arch], tunix[arch], compare[arch]
        each = ", ".join(f"{x['first_ratio_tunix_over_ours']:.2f}" for x in c)
        warm = median([x["first_ratio_tunix_over_ours_incl_warmup"] for x in c])
        rows.append(
            f"| first GRPO step with compiles (ours: + warm-up before the loop), {label} |"
            f" {median([x['step_s_first'] for x in o]):.1f} s"
            f" (+{median([x['warmup_s'] for x in o]):.1f} s)"
            f" | {median([x['step_s_first'] for x in t]):.1f} s | - |"
            f" {_ratio(median([x['first_ratio_tunix_over_ours'] for x in c]))} ({each}); {_ratio(warm)} with"
            " warmup |"
        )
    for arch, label in ARCHS:
        p = peer[arch]  # the file's last run; the ratios of the earlier ones follow
        earlier = "; ".join(
            f"{_ratio(x.get('ours_vs_tunix'))}, {_ratio(x.get('ours_vs_transformers'))}"
            for x in peer_runs[arch][:-1]
        )
        rows.append(
            f"| decode tok/s, batch 16, {label} (ours: 8 steps per call; 1 step) | {p['ours_tok_s']:,.0f}"
            f" ({p['ours_decode_steps_1_tok_s']:,.0f}) | {p.get('tunix_tok_s', 0):,.0f} |"
            f" {p.get('transformers_tok_s', 0):,.0f} | {_ratio(p.get('ours_vs_tunix'))} Tunix,"
            f" {_ratio(p.get('ours_vs_transformers'))} transformers"
            + (f" (earlier run: {earlier})" if earlier else "")
            + " |"
        )
    phases = []
    for arch, label in ARCHS:
        ph = {k: median([x["phase_s_median_after_first"][k] for x in ours[arch]]) for k in PHASES}
        mfu = median([x["train_mfu"]["train"]["mfu"] for x in ours[arch]])
        phases.append(
            f"{label}: generate {ph['generate']:.2f} s, reference log-probs {ph['reference_logprobs']:.2f} s,"
            f" train {ph['train']:.2f} s (MFU {100 * mfu:.0f}% of the f32 matmul peak measured in the run),"
            f" weight sync {ph['weight_sync']:.3f} s"
        )
    spec = [line for line in decode if line.get("bench") == "decode_speculative"]
    notes = ["", "Our step's phases (medians over the runs): " + "; ".join(phases) + "."]
    if spec:
        by = spec[-1]["by_batch"]
        earlier = "; ".join(
            ", ".join(f"{v['speedup']:.2f}x" for v in line["by_batch"].values()) for line in spec[:-1]
        )
        notes.append(
            "Speculative decoding (k = 4, the trained pair of `benchmarks/decode.py`), T = 1, wall-clock"
            " speedup over plain decoding of the same target by batch, one step per call each: "
            + ", ".join(
                f"{k[1:]}: {v['speedup']:.2f}x ({v['speedup_vs_decode_steps_8']:.2f}x over 8 steps per call,"
                f" acceptance {v['acceptance_rate']:.2f}"
                + (
                    f"; 8 speculative steps per call: {v['speedup_n8']:.2f}x over 8 plain steps per call,"
                    f" {v['speedup_n8_vs_decode_steps_1']:.2f}x over one"
                    if "speedup_n8" in v
                    else ""
                )
                + ")"
                for k, v in by.items()
            )
            + (f" (earlier run: {earlier})" if earlier else "")
            + "."
        )
    loads = [x["loadavg_start"][0] for a, _ in ARCHS for x in ours[a]] + [
        x["loadavg_start"][0] for a, _ in ARCHS for x in peer_runs[a]
    ]
    notes.append(f"Load average (1 min) at the start of each measurement: {min(loads):.2f}-{max(loads):.2f}.")
    return "\n".join(rows + notes)


def write(path: str) -> None:
    schema.write_between(path, BEGIN, END, table() + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--write", default="", help="a README whose peer-table markers get the table")
    a = p.parse_args()
    if a.write:
        write(a.write)
    else:
        print(table())


if __name__ == "__main__":
    main()
