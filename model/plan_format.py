"""Tables of the planner's JSON-ready results (`model.plan`, `rl.plan.rollout`, `rl.plan.xla`)."""

from __future__ import annotations


def _si(n: float) -> str:
    e, s = next((e, s) for e, s in ((12, "T"), (9, "B"), (6, "M"), (3, "K"), (0, "")) if n >= 10**e)
    return f"{n / 10**e:.3g}{s}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _mesh(sizes: dict, devices: int) -> str:
    named = " ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "one device"
    return f"{named}  ({devices} devices)"


def _rows(rows) -> str:
    return "\n".join(f"{k:<20}{v}" for k, v in rows)


def format_table(p: dict) -> str:
    """The training plan (`model.plan.plan`) as a human-readable table."""
    micro = f", {p['micro_batches']} micro-batches" if p.get("micro_batches", 1) > 1 else ""
    rows = [
        ("mesh", _mesh(p["mesh"], p["devices"])),
        ("tokens", f"batch {p['batch']} x seq_len {p['seq_len']}, remat {p['remat']}{micro}"),
        ("params", f"{_si(p['params_total'])} total, {_si(p['params_active'])} active"),
        ("  routed experts", _si(p["params_experts"])),
        ("  embeddings", f"{_si(p['params_embedding'])} in, {_si(p['params_unembedding'])} out"),
        (
            "FLOPs/token",
            f"{p['flops_per_token_train']:.4g} train, {p['flops_per_token_forward']:.4g} forward",
        ),
        ("KV cache/token", f"{p['kv_cache_bytes_per_token']:,} bytes (compute dtype, all layers)"),
        ("params/device", _gib(p["param_bytes_per_device"])),
        ("  routed experts", _gib(p["expert_param_bytes_per_device"])),
        (
            "grads, adamw/device",
            f"{_gib(p['grad_bytes_per_device'])} (f32), {_gib(p['adamw_bytes_per_device'])}",
        ),
        ("activations/device", _gib(p["activation_bytes_per_device"])),
        ("total/device", _gib(p["total_bytes_per_device"])),
        (f"fits {p['hbm_gib']:g} GiB", "yes" if p["fits"] else "NO"),
    ]
    if p.get("ep_buffer_bytes") is not None:
        factor = p["ep_capacity_factor"]
        capped = f", {_gib(p['ep_buffer_bytes'])} at ep_capacity_factor {factor:g}" if factor else ""
        rows.append(
            (
                "EP buffer/layer",
                f"{_gib(p['ep_buffer_bytes_dropless'])} dropless{capped} (one of 4; not in total)",
            )
        )
    return _rows(rows + [("warning", w) for w in p["warnings"]])


def format_rollout(p: dict) -> str:
    """The rollout entries (`rl.plan.rollout.rollout_plan`) as a table."""
    kv_layout = "split over tensor" if p["kv_sharded_over_tensor"] else "replicated over tensor"
    rows = [
        ("inference mesh", _mesh(p["inference_mesh"], p["inference_devices"])),
        (
            "weights/device",
            f"{_gib(p['weight_bytes_per_device'])} ({p['weight_dtype']}), routed experts "
            f"{_gib(p['expert_weight_bytes_per_device'])}",
        ),
        (
            "KV/token/device",
            f"{p['kv_bytes_per_token_per_device']:,} bytes ({p['kv_dtype']}, {kv_layout}; "
            f"{p['kv_cache_bytes_per_token']:,} per token in all)",
        ),
        ("KV/sequence/device", f"{_gib(p['kv_bytes_per_sequence_per_device'])} at context {p['context']:,}"),
        (
            "sequences/device",
            f"{p['sequences_per_device']:,} beside the weights in {p['hbm_gib']:g} GiB "
            f"({p['sequences_on_mesh']:,} on the mesh)",
        ),
    ] + [("warning", w) for w in p["rollout_warnings"]]
    return _rows(rows)


def format_a2a(p: dict, mesh_name: str, *, training: bool) -> str:
    """All-to-all entries (`rl.plan.rollout.all_to_all_plan`) of one mesh as a table."""
    step = f"; train step (forward + backward) {_gib(p['a2a_bytes_per_train_step'])}" if training else ""
    rows = [
        ("  per MoE layer", f"{_gib(p['a2a_bytes_per_layer'])} sent per device (dispatch + combine)"),
        ("  per forward", f"{_gib(p['a2a_bytes_per_forward'])} over {p['a2a_moe_layers']} MoE layers{step}"),
    ]
    title = f"all-to-all on the {mesh_name}: {p['a2a_tokens_per_device']:,} tokens/device, balanced routing"
    return title + "\n" + _rows(rows)


def format_memory(p: dict) -> str:
    """The live bytes per device (`rl.plan.memory.device_bytes`, the main job's memory/*), and with the
    train step's f32 gradients and activations of the plan above."""
    d = p["device_bytes"]
    rows = [(f"  {k}", f"{_gib(v)} ({v:,} bytes)") for k, v in d.items()]
    step = d["total"] + p["grad_bytes_per_device"] + p["activation_bytes_per_device"]
    fits = "fits" if step <= p["hbm_gib"] * 2**30 else "does NOT fit"
    rows += [
        ("  + train step", f"{_gib(step)} with f32 gradients and activations ({fits} {p['hbm_gib']:g} GiB)"),
    ]
    return "live bytes per device (memory/*, largest device)\n" + _rows(rows)


def format_xla(p: dict) -> str:
    """The xla_* entries (`rl.plan.xla.xla_plan`): XLA's bytes, the estimate, their ratio."""
    out = [f"{'XLA train step':<20}{'XLA':>15}{'estimate':>15}{'XLA/est':>9}  (bytes per device)"]
    for key, v in p.items():
        if key.startswith("xla_"):
            a, b = v["xla"], v["estimate"]
            out.append(f"  {key[4:]:<18}{a:>15,}{b:>15,}{(f'{a / b:.3f}' if b else '-'):>9}")
    return "\n".join(out)


def format_all(p: dict) -> str:
    """Every section the result holds: training plan, all-to-all, rollout, XLA."""
    parts = [format_table(p)]
    if p.get("train_a2a"):
        parts.append(format_a2a(p["train_a2a"], "training mesh", training=True))
    if "inference_mesh" in p:
        parts.append(format_rollout(p))
        if p.get("rollout_a2a"):
            parts.append(format_a2a(p["rollout_a2a"], "inference mesh", training=False))
    if "device_bytes" in p:
        parts.append(format_memory(p))
    if any(k.startswith("xla_") for k in p):
        parts.append(format_xla(p))
    return "\n\n".join(parts)
