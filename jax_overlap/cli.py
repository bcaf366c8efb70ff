"""`jax-overlap` command line: train | schedule | analyze | profile | tune | prepare-data |
convert | evaluate | generate.

Thin on purpose: parse flags, build the typed config, call the library. The config is read
before JAX starts so that the process can ask for exactly as many host devices as the mesh
needs and apply XLA flag presets. User errors print one line per problem and exit with 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from jax_overlap.config import Config, ConfigError

USER_ERROR = 2
JSON_HELP = "print one JSON document instead of text"


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (argparse prints one line and exits with 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line and exit 2, like every other user error (no usage block)."""

    def error(self, message: str):
        self.exit(USER_ERROR, f"error: {message}; see `{self.prog} --help`\n")


def _positive(kind):
    """argparse type: a number > 0 of `kind` (int or float); one line and exit 2 otherwise."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} > 0 (leave the flag out "
                                             f"for the default)")
        return value
    noun = "an integer" if kind is int else "a number"
    return parse


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML file, e.g. configs/tiny.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=10 (repeatable)")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default="", help="host:port of process 0 (multi-process)")
    p.add_argument("--num-processes", type=int, default=0,
                   help="processes in the run (0: distributed.num_processes or JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=-1,
                   help="this process's rank (-1: distributed.process_id or JAX_PROCESS_ID)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jax-overlap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a config")
    _add_config_args(p)
    _add_distributed_args(p)
    p.add_argument("--run-dir", default="runs/latest", help="metrics.jsonl and checkpoints go here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("schedule", help="print a pipeline schedule as a table")
    p.add_argument("--schedule", required=True,
                   help="gpipe, 1f1b, interleaved, zb-h1 or zb-v")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages (mesh.pp)")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    p.add_argument("--virtual", type=int, default=1,
                   help="chunks per stage (interleaved: >= 2; zb-v: 2)")
    p.add_argument("--transfer-latency", type=int, default=1,
                   help="ticks between stages: 2 overlaps transfers with the next tick")
    p.add_argument("--paired", action="store_true",
                   help="paired F+B ticks: a stage runs a forward and a backward per tick")
    p.add_argument("--pair-search", type=int, default=0,
                   help="with --paired: steps of the search over which ticks run pairs")
    p.add_argument("--tick-costs", default=None,
                   help="with --paired: F,B,W tick times the pairing balances, e.g. 15.2,18.8,18.6")
    p.add_argument("--costs", default=None, metavar="F,B,W,C",
                   help="action times and one transfer's, e.g. 18.5,18.1,9.3,0.6: report "
                        "weighted_bubble, the executor's bubble at these costs (and choose "
                        "a --paired table for them)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)

    p = sub.add_parser("analyze", help="collectives and overlap of the compiled train step")
    _add_config_args(p)
    p.add_argument("--target", default="cpu", choices=["cpu", "a100", "h100", "h200"],
                   help="compile for these devices; a GPU target compiles deviceless (no GPU "
                        "needed) and adds the step estimate")
    p.add_argument("--top", type=_non_negative_int, default=0, metavar="N",
                   help="on a GPU target: also list the N costliest non-GEMM kernels of the "
                        "step estimate")
    p.add_argument("--json", action="store_true", help=JSON_HELP)

    p = sub.add_parser("profile", help="trace N steps and compute CCOR, bubble, exposed comm")
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=3, help="steps traced after the warm-up")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--logdir", default="",
                   help="keep the trace here, for XProf / Perfetto (default: runs/profile)")

    p = sub.add_parser("prepare-data", help="tokenize text files into token shards")
    p.add_argument("--input", nargs="+", required=True, metavar="FILES_OR_GLOB",
                   help="files, globs (quoted), directories, or `stdlib`")
    p.add_argument("--out", required=True, help="shard directory (data.path)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="bytes", help="`bytes` or a tokenizer.json")
    tok.add_argument("--train-tokenizer", type=_positive(int), default=0, metavar="VOCAB",
                     help="train a byte-level BPE of VOCAB (257..1048576) tokens on the input "
                          "first")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="the last fraction of the tokens, written as the held-out split")
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"],
                   help="token dtype on disk (auto: uint16 where the vocabulary fits)")
    p.add_argument("--max-bytes", type=_positive(int), default=0,
                   help="read at most this many bytes (default: all)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("tune", help="rank parallel plans with the calibrated simulator")
    _add_config_args(p)
    p.add_argument("--devices", type=int, required=True, help="devices to plan for")
    p.add_argument("--hardware", default="cpu_here",
                   help="a profile of configs/hardware/ (name or path): link and compute speeds")
    p.add_argument("--measure", type=int, default=0,
                   help="run the top this many plans for real (0..16) and compare")
    p.add_argument("--estimate", type=_non_negative_int, default=0, metavar="K",
                   help="compile the top K plans for --target GPUs (deviceless) and rank them "
                        "by the estimate of their compiled step")
    p.add_argument("--target", default="h100", choices=["a100", "h100", "h200"],
                   help="the GPUs --estimate compiles for")
    p.add_argument("--out", default="", help="write the best plan's config here (YAML); "
                                              "nothing is written without it")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--allow-stale", action="store_true",
                   help="the best plan may train with stale gradients (overlap.dcn_delay=1 "
                        "or Streaming DiLoCo across hosts)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    p = sub.add_parser("convert", help="Hugging Face directory <-> run directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF config.json + safetensors")
    src.add_argument("--to-hf", metavar="RUN_DIR", help="a run's newest verified checkpoint")
    p.add_argument("--out", required=True, help="the run directory / HF directory to write")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="--to-hf weights")
    p.add_argument("--shard-mb", type=_positive(float), default=0.0,
                   help="--to-hf: shards of at most this many MiB with an index (default: "
                        "one file)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's config (repeatable)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)

    p = sub.add_parser("evaluate", help="mean next-token loss and perplexity over a text file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="score the run's newest verified checkpoint")
    src.add_argument("--from-hf", metavar="DIR", help="score a Hugging Face directory")
    p.add_argument("--data", required=True,
                   help="a text file (tokenized with the model's tokenizer), or a "
                        "prepare-data directory (its held-out split is scored)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's config (repeatable)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)

    p = sub.add_parser("generate", help="continue a prompt with a run's or an HF model")
    # One of the two, checked by cmd_generate (one line, not argparse's usage block).
    p.add_argument("--run-dir", help="the run's newest verified checkpoint")
    p.add_argument("--from-hf", metavar="DIR", help="a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 64, or as many as model.seq_len leaves after the prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's config (repeatable)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    return parser


def load_config(args) -> Config:
    from jax_overlap import config

    overrides = list(args.overrides)
    if getattr(args, "coordinator", ""):
        overrides.append(f"distributed.coordinator={args.coordinator}")
    if getattr(args, "num_processes", 0):
        overrides.append(f"distributed.num_processes={args.num_processes}")
    if getattr(args, "process_id", -1) >= 0:
        overrides.append(f"distributed.process_id={args.process_id}")
    return config.load(args.config, overrides)


def prepare_backend(cfg: Config, devices_needed: int | None = None) -> None:
    """Everything that must precede JAX's backend start-up, in order."""
    from jax_overlap.parallel.mesh import force_host_devices

    gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
    if "JAX_PLATFORMS" not in os.environ and not gpu:
        os.environ["JAX_PLATFORMS"] = "cpu"  # no GPU here: don't probe CUDA plugins
    needed = devices_needed or cfg.num_devices
    force_host_devices(max(1, needed // max(1, cfg.distributed.num_processes)))
    _apply_xla_preset(cfg, accelerator=gpu and os.environ.get("JAX_PLATFORMS", "") != "cpu")


def _apply_xla_preset(cfg: Config, accelerator: bool) -> None:
    """`overlap.xla_preset` (`auto`: the plan's rule for the platform) into XLA_FLAGS."""
    from jax_overlap.plan import auto_xla_preset

    name = cfg.overlap.xla_preset
    if name == "auto":
        name = auto_xla_preset(accelerator, cfg)
    if name != "none":
        from jax_overlap.overlap import xla_flags

        xla_flags.apply_preset(name)


def check_train_request(cfg: Config, run_dir: str) -> None:
    """What can be refused before JAX starts: paths, a held run dir, a run dir holding another
    run (`resilience/run_identity.py`), memory (on CPU, where the devices share the host's
    RAM; a GPU's memory is checked once JAX knows it)."""
    from jax_overlap.resilience import lock, preflight, run_identity
    from jax_overlap.training.assemble import plan_for

    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    problems = preflight.path_problems(run_dir, ckpt_dir, cfg.checkpoint.every_steps > 0)
    process_id = int(os.environ.get("JAX_PROCESS_ID", cfg.distributed.process_id) or 0)
    if not problems and process_id == 0:  # the others join process 0's lock
        held = lock.holder_problem(run_dir) or run_identity.another_run(run_dir, cfg.to_dict())
        problems = [held] if held else []
    if not problems and not glob.glob("/dev/nvidia[0-9]*"):
        plan = plan_for(cfg)
        problems = preflight.memory_problems(
            cfg.model, cfg.train, cfg.data, plan, device_bytes=None,
            local_devices=max(1, cfg.num_devices // max(1, cfg.distributed.num_processes)),
            host_bytes=preflight.host_memory_bytes())
    if problems:
        raise ConfigError(problems)


def cmd_train(args) -> int:
    cfg = load_config(args)
    check_train_request(cfg, args.run_dir)
    from jax_overlap.resilience import run_log

    run_log.install(args.run_dir, int(os.environ.get("JAX_PROCESS_ID", cfg.distributed.process_id) or 0))
    prepare_backend(cfg)
    from jax_overlap.parallel import mesh
    from jax_overlap.training import loop as train

    d = cfg.distributed
    mesh.init_distributed(d.coordinator, d.num_processes, d.process_id, d.timeout_s)
    result = train.run(cfg, args.run_dir, progress=not args.no_progress)
    import jax

    if jax.process_index() == 0:
        print(json.dumps(result.summary()), flush=True)
    return 0


def cmd_schedule(args) -> int:
    from jax_overlap.pipeline.schedules import schedule_command

    print(schedule_command(args.schedule, args.stages, args.microbatches, args.virtual,
                           as_json=args.json, transfer_latency=args.transfer_latency,
                           paired=args.paired, tick_costs=args.tick_costs,
                           pair_search=args.pair_search, costs=args.costs))
    return 0


def prepare_deviceless(cfg: Config) -> None:
    """Before JAX starts, to compile for GPUs without one: the backend stays on CPU (no
    forced host devices: the mesh is built on the plugin's topology), the preset applies."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _apply_xla_preset(cfg, accelerator=True)


def cmd_analyze(args) -> int:
    cfg = load_config(args)
    if args.target == "cpu":
        prepare_backend(cfg)
    else:
        prepare_deviceless(cfg)
    from jax_overlap.analysis import analyze

    print(analyze.analyze_command(cfg, args.target, as_json=args.json, top=args.top))
    return 0


def cmd_profile(args) -> int:
    cfg = load_config(args)
    prepare_backend(cfg)
    from jax_overlap.analysis import profile

    print(profile.profile_command(cfg, args.steps, as_json=args.json, logdir=args.logdir))
    return 0


MAX_TUNE_DEVICES = 1024  # the tuner forces this many host devices to calibrate on


def cmd_tune(args) -> int:
    cfg = load_config(args)
    if not 1 <= args.devices <= MAX_TUNE_DEVICES:
        raise ValueError(f"--devices: must be in 1..{MAX_TUNE_DEVICES}, got {args.devices}")
    if not 0 <= args.measure <= 16:
        raise ValueError(f"--measure: must be in 0..16 (plans run for real), got {args.measure}")
    if args.out:  # before the calibration, which takes a while
        from jax_overlap.resilience import preflight

        bad = preflight.out_file_problem(args.out, "--out")
        if bad:
            raise ConfigError([bad])
    prepare_backend(cfg, devices_needed=max(cfg.num_devices, args.devices))
    from jax_overlap.analysis import tune

    print(tune.tune_command(cfg, args.devices, args.hardware, measure=args.measure,
                            out=args.out, as_json=args.json,
                            allow_stale=args.allow_stale, estimate=args.estimate,
                            target=args.target, progress=not args.no_progress))
    return 0


def cmd_prepare_data(args) -> int:
    from jax_overlap.data import prepare

    result = prepare.prepare(args.input, args.out, tokenizer=args.tokenizer,
                             train_vocab=args.train_tokenizer, val_fraction=args.val_fraction,
                             dtype=args.dtype, max_bytes=args.max_bytes,
                             progress=not args.no_progress)
    print(result.line(), flush=True)
    return 0


def cmd_convert(args) -> int:
    from jax_overlap.hf import convert
    from jax_overlap.training import hf_runs

    if args.from_hf:
        cfg = convert.hf_run_config(args.from_hf, args.overrides)
        prepare_backend(cfg)
        out = hf_runs.from_hf(args.from_hf, args.out, args.overrides)
    else:
        prepare_backend(Config(), devices_needed=1)
        out = hf_runs.to_hf(args.to_hf, args.out, args.dtype, args.shard_mb, args.overrides)
    print(json.dumps(out) if args.json else " ".join(f"{k}={v}" for k, v in out.items()))
    return 0


def cmd_evaluate(args) -> int:
    from jax_overlap.training import scoring

    if args.run_dir:
        from jax_overlap.training.run_state import run_config

        cfg = run_config(args.run_dir, args.overrides)
    else:
        from jax_overlap.hf.convert import hf_run_config

        cfg = hf_run_config(args.from_hf, args.overrides)
    prepare_backend(cfg)
    out = scoring.evaluate_command(args.run_dir, args.from_hf, args.data, args.overrides)
    print(json.dumps(out) if args.json else
          f"loss {out['loss']:.4f}  perplexity {out['perplexity']:.3f}  ({out['tokens']} tokens)")
    return 0


def cmd_generate(args) -> int:
    from jax_overlap.training import generate

    if bool(args.run_dir) == bool(args.from_hf):
        raise ConfigError(["--run-dir / --from-hf: give exactly one (a run directory or a "
                           "Hugging Face directory)"])
    generate.check_options(args.max_new_tokens, args.temperature, args.top_k)
    cfg = generate.generation_config(args.run_dir, args.from_hf, args.overrides)
    tok = generate.run_tokenizer(cfg, args.run_dir, args.from_hf)
    generate.prompt_ids(tok, args.prompt, cfg.model, args.max_new_tokens)  # before JAX starts
    prepare_backend(cfg)
    out = generate.generate_command(args.run_dir, args.from_hf, args.prompt,
                                    args.max_new_tokens, args.temperature, args.top_k,
                                    args.seed, args.overrides)
    print(json.dumps(out) if args.json else out["text"], flush=True)
    return 0


COMMANDS = {"train": cmd_train, "schedule": cmd_schedule, "analyze": cmd_analyze,
            "profile": cmd_profile, "tune": cmd_tune, "prepare-data": cmd_prepare_data,
            "convert": cmd_convert, "evaluate": cmd_evaluate, "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return USER_ERROR
    except Exception as e:  # noqa: BLE001 - one line on the terminal, whatever it is
        from jax_overlap.resilience import run_log, user_errors

        line = user_errors.user_error_line(e)
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            return USER_ERROR
        where = run_log.write_traceback(e) or _traceback_file(e)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"error: internal error, {type(e).__name__}: {first} (traceback in {where})",
              file=sys.stderr)
        return 1


def _traceback_file(e: BaseException) -> str:
    """Where an unexpected error's traceback goes when there is no run log."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="jax-overlap-error-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    return path


if __name__ == "__main__":
    sys.exit(main())
