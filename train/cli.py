"""``falcon-train`` / ``python -m falcon_jax.train``: the command line.

    falcon-train --preset addition-tiny
    falcon-train --preset lm-tiny --model gated_deltanet --set train.steps=100
    falcon-train --config run.toml --set optim.lr=3e-4 --set mesh.fsdp=4
    falcon-train --run-dir runs/addition-tiny --resume      # config from the run's config.json

Exit codes: 0 done, or stopped before train.time_limit_s with a checkpoint (the last line says how to
continue); 2 a config or run-directory error (nothing trained); 1 a failure while training (out of device
memory: the message names the batch and the fixes; a NaN or infinite loss, stopped before it is saved; a
checkpoint that could not be written, a disk error);
130 / 143 stopped by SIGINT / SIGTERM after writing a checkpoint (the last line says how to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from falcon_jax.train.config import PRESETS, ConfigError, TrainConfig, build_config
from falcon_jax.train.memory import DeviceMemoryError
from falcon_jax.train.preemption import Interrupted
from falcon_jax.train.rundir import CONFIG, RunDirError, checkpoint_config, checkpoint_steps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="falcon-train", description="Train Falcon (and baseline) language models "
                                "on the addition task or local text.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", help=f"named setting: {', '.join(PRESETS)}")
    p.add_argument("--config", help="a .json or .toml config file (sections model/data/optim/train/mesh/checkpoint)")
    p.add_argument("--model", help="mixer name, e.g. falcon-1A.3, falcon-3A, transformer, mamba2, gated_deltanet")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--run-dir", help="shorthand for --set train.run_dir=DIR")
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in the run dir "
                   "(an error if there is none)")
    p.add_argument("--resume-or-start", action="store_true", help="continue from the latest good checkpoint, or "
                   "start from step 0 if there is none (for jobs that a scheduler restarts)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    return p


def resolve(args) -> TrainConfig:
    overrides = list(args.set)
    if args.run_dir:
        overrides.append(f"train.run_dir={args.run_dir}")
    if args.preset is None and args.config is None:
        if (args.resume or args.resume_or_start) and args.run_dir:
            # resuming a run by its directory alone: start from the config it was started with
            saved = os.path.join(args.run_dir, CONFIG)
            if os.path.exists(saved):
                return build_config(config_file=saved, model=args.model, overrides=overrides)
            found = checkpoint_config(args.run_dir)
            if found:  # config.json deleted or lost: every checkpoint carries the run's config
                print(f"falcon-train: {saved} is missing; resuming with the config saved in checkpoint {found[0]} "
                      f"(written back to {CONFIG} once the run is accepted)", file=sys.stderr)
                return build_config(saved=found[1], model=args.model, overrides=overrides)
            where = (f"{args.run_dir} holds no {CONFIG}" if os.path.isdir(args.run_dir)
                     else f"{args.run_dir} does not exist")
            flag = "--resume" if args.resume else "--resume-or-start"
            raise ConfigError(f"--run-dir {args.run_dir} {flag}: {where}, so there is no run to resume (a run "
                              "folder keeps the config it was started with); check the path, or start the run with "
                              "--preset NAME or --config FILE (--resume-or-start continues it if it is there). "
                              f"Presets: {', '.join(PRESETS)}.")
        raise ConfigError("give --preset NAME or --config FILE (or --run-dir DIR --resume for an existing run); "
                          f"presets: {', '.join(PRESETS)}.")
    return build_config(preset=args.preset, config_file=args.config, model=args.model, overrides=overrides)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.list_presets:
        for name, p in PRESETS.items():
            print(f"{name:16s} model={p['model'].get('mixer')} d={p['model'].get('d_model')} "
                  f"L={p['model'].get('n_layers')} data={p['data']['kind']} steps={p['train']['steps']}")
        return 0
    try:
        cfg = resolve(args)  # every value checked (config.validate)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"falcon-train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    # imported here, so that --help, --list-presets, --print-config and config errors answer sooner
    from falcon_jax.train.checkpoint import CheckpointError
    from falcon_jax.train.mesh import MeshError
    from falcon_jax.train.trainer import TrainingDiverged, run
    try:
        run(cfg, resume=args.resume, resume_or_start=args.resume_or_start, standalone=True)
    except (MeshError, RunDirError, ConfigError, FileNotFoundError) as e:
        print(f"falcon-train: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"falcon-train: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C
        print("falcon-train: interrupted (SIGINT) before a checkpoint of the current step was written; "
              "--resume continues from the last checkpoint, if there is one.", file=sys.stderr)
        return 128 + signal.SIGINT
    except (DeviceMemoryError, TrainingDiverged) as e:
        print(f"falcon-train: error: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"falcon-train: error: {e}", file=getattr(e, "terminal", None) or sys.stderr)
        return 1
    except OSError as e:  # a disk error while training (the metrics, the report): say what is kept
        steps = checkpoint_steps(cfg.train.run_dir)
        kept = (f"; the checkpoints in {cfg.train.run_dir} (the latest: step {steps[-1]}) are kept: fix the cause, then "
                f"continue with: falcon-train --run-dir {cfg.train.run_dir} --resume") if steps else ""
        print(f"falcon-train: error: {e}{kept}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
