"""Child of tests/inference/test_engine_hosts.py: one of two processes (4 fake CPU devices each) that
builds the test config's train state on a trainer mesh of fsdp 8 over both, pushes it to
two sampler layouts in turn (`rl.sampler.Layout.push`): one engine over both processes, then one per
process, each expert 2 x tensor 2; for each it prints one JSON line: the engine's tokens and log-probs on
the parent's prompts, its devices, and the largest bytes its weights hold on one local device.

    python tests/inference/engine_hosts_child.py PROCESS_ID PORT
"""

import dataclasses
import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import engine_hosts_common as common

    from inference import Engine, NgramDrafter
    from rl import distributed, memory, sampler, train_state, validate

    cfg = common.config(fsdp=8)
    mesh = distributed.trainer_mesh(cfg)
    _, state = train_state.init_state(cfg, mesh=mesh, seed=common.SEED)
    engine_cfg = validate.engine_config(cfg)
    for per in (0, 1):  # one engine over both processes, then one per process
        cfg.rl.engine.mesh.update(processes=per, expert=2, tensor=2)
        place = sampler.layout(cfg, mesh)
        weights = place.engine_weights(train_state.weights(state), cfg, engine_cfg)
        engine = Engine(cfg, weights, engine_cfg, mesh=place.mesh, placed=place.placed)
        out = common.run(engine)
        bytes_by_device = memory.per_device(jax.tree.leaves(engine.params))
        out.update(
            per=per,
            engine_processes=sorted({d.process_index for d in place.mesh.devices.flat}),
            engine_size=int(place.mesh.devices.size),
            engine_shape={k: int(v) for k, v in place.mesh.shape.items()},
            weight_bytes=max(bytes_by_device.values()),
            lockstep=place.lockstep,
        )
        print("RESULT " + json.dumps(out), flush=True)
        del engine, weights
    # One engine over both again, speculative (n-gram drafts), in a pool of 4 pages (the null page and 3) that
    # the CROWD prompts overfill as they grow.
    cfg.rl.engine.mesh.update(processes=0, expert=2, tensor=2)
    place = sampler.layout(cfg, mesh)
    small = dataclasses.replace(engine_cfg, num_pages=4, prefix_cache_pages=0, decode_steps=1)
    weights = place.engine_weights(train_state.weights(state), cfg, small)
    engine = Engine(cfg, weights, small, draft=NgramDrafter(2), mesh=place.mesh, placed=place.placed)
    out = common.run(engine, common.CROWD)
    stats = engine.stats()
    out.update(per="spec", preemptions=stats.get("preemptions", 0), proposed=stats["proposed_tokens"])
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
