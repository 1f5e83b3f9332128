"""``slackswap fit``: a Hugging Face model's training step profiled fake, and whether it fits
the device (fit.py), or the largest batch or sequence that does with the strategies compared
there (fit_search.py)."""

from __future__ import annotations

import json
from pathlib import Path


def add_fit(sub) -> None:
    """The fit command's options."""
    from .cli import _memory_arg

    p = sub.add_parser(
        "fit",
        help="will a Hugging Face model's training step fit the device? "
        "(profiled fake: no weights, no memory)",
    )
    p.add_argument(
        "model",
        help="a model_type (gpt2, bert, llama, mistral, qwen2, gemma2, phi3, gpt_neox, ...), a "
        "config.json or a folder holding one, or a model id in the local Hugging Face cache",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        help="JSON object of config fields, passed to the config's constructor over the "
        "family's defaults or the file's values (derived fields follow)",
    )
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--precision",
        default="pure",
        choices=("pure", "mixed", "mixed-fp16", "fsdp-mixed"),
        help="pure (default, torch's): parameters, gradients and optimizer state in --dtype; "
        "mixed: float32 master parameters, gradients and moments, the forward under autocast "
        "in bf16 (mixed-fp16: fp16); fsdp-mixed: FSDP2's MixedPrecisionPolicy(param_dtype="
        "bfloat16), float32 shards and the forward on parameters gathered in bf16",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="the parameters' dtype under --precision pure (default bfloat16)",
    )
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd-momentum, sgd or none")
    p.add_argument(
        "--foreach",
        choices=("auto", "on", "off"),
        default="auto",
        help="the optimizer's multi-tensor step (auto: torch's default, on for CUDA devices)",
    )
    p.add_argument(
        "--gradients",
        default="auto",
        choices=("auto", "made", "held"),
        help="parameter gradients made in the step (torch's zero_grad() sets them to None), or "
        "held across steps; auto (the API's default too): made unless the model has gradients",
    )
    p.add_argument(
        "--hardware", default="a100-80gb-pcie4", help="hardware preset (default %(default)s)"
    )
    p.add_argument(
        "--memory", type=_memory_arg, help="device memory instead of the preset's, e.g. 24GB"
    )
    p.add_argument(
        "--host-memory",
        type=_memory_arg,
        help="host memory swapped tensors may take instead of the preset's, e.g. 64GB",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="FSDP2 ranks the model state is sharded over (fully_shard); says the fewest that fit",
    )
    p.add_argument(
        "--collectives-on-link",
        action="store_true",
        help="with --ranks: FSDP2's all-gathers and reduce-scatters cross the same host link as "
        "the swaps (PCIe nodes without NVLink), so they share its copy lanes",
    )
    p.add_argument("--solver", default="cpsat")
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for the plan (default %(default)s)"
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="find the largest micro-batch that fits (at --seq), and compare the strategies there",
    )
    p.add_argument(
        "--max-seq",
        action="store_true",
        help="find the longest sequence that fits (at --batch), and compare the strategies there",
    )
    p.add_argument(
        "--plot", help="with --max-batch/--max-seq: tokens/s against the size, saved here"
    )
    p.add_argument(
        "--pipeline-stages",
        type=int,
        default=0,
        help="pipeline stages: each rank's model state and activations under the schedule, "
        "the answer for the worst rank (--batch is the micro-batch)",
    )
    p.add_argument(
        "--micro-batches", type=int, default=0, help="with --pipeline-stages: micro-batches a step"
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=("1f1b", "gpipe", "interleaved-1f1b"),
        help="with --pipeline-stages: torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe "
        "or ScheduleInterleaved1F1B",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        help="with --schedule interleaved-1f1b: stages on each rank (they share its memory)",
    )
    p.add_argument("--out", help="write the graph JSON here (with --max-*: the search's JSON)")
    p.add_argument("--plan", help="write the plan JSON here")
    p.set_defaults(func=cmd_fit)


def _fit_hardware(args):
    """The preset, with the collectives on its copy lanes where --collectives-on-link says so."""
    from dataclasses import replace

    from .core.hardware import hardware

    hw = hardware(args.hardware)
    return replace(hw, collectives_on_link=True) if args.collectives_on_link else hw


def cmd_fit(args) -> int:
    """Profile a Hugging Face config fake (no weights, no activation memory) and say whether its
    training step fits the device, and how fast it runs there."""
    from .cli import _Spinner, check_output
    from .cli_errors import CliError
    from .fit import fit, rank_graph
    from .runtime.hf_models import ModelSpecError, meta_model, training_batch
    from .runtime.profiler import profile

    try:
        overrides = json.loads(args.hf_config) if args.hf_config else {}
    except json.JSONDecodeError as exc:
        raise CliError(f"--hf-config is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise CliError("--hf-config must be a JSON object of config fields")
    if args.plan:
        check_output(args.plan)
    mixed = args.precision != "pure"
    if mixed and args.dtype not in (None, "float32"):
        raise CliError(
            f"--precision {args.precision} keeps float32 master parameters; --dtype {args.dtype} "
            "is the pure regime's (parameters, gradients and moments in one dtype)"
        )
    if args.ranks < 1:
        raise CliError(f"--ranks must be a positive integer, got {args.ranks}")
    pipelined = args.pipeline_stages > 0
    if pipelined and (args.ranks > 1 or args.max_batch or args.max_seq or args.plan):
        raise CliError(
            "--pipeline-stages answers for one schedule: not with --ranks, --max-batch, "
            "--max-seq or --plan"
        )
    if pipelined and args.micro_batches < 1:
        raise CliError("--pipeline-stages needs --micro-batches (a positive integer)")
    if not pipelined and args.micro_batches:
        raise CliError("--micro-batches is for --pipeline-stages")
    if pipelined and args.gradients == "made":
        raise CliError(
            "--pipeline-stages: a stage accumulates its gradients over the micro-batches and "
            "holds them beside its activations; --gradients made counts them in each backward"
        )
    sharded = args.ranks > 1 or args.precision == "fsdp-mixed" or pipelined
    if sharded and args.gradients == "made":
        flag = "--ranks" if args.ranks > 1 else "--precision fsdp-mixed"
        raise CliError(
            f"{flag}: FSDP2 reduce-scatters gradients into shards held beside the step; "
            "--gradients made counts whole ones in backward"
        )
    if args.collectives_on_link and args.ranks < 2 and not pipelined:
        raise CliError(
            "--collectives-on-link needs --ranks 2 or more, or --pipeline-stages (one device "
            "has none)"
        )
    if args.max_batch and args.max_seq:
        raise CliError("--max-batch and --max-seq: one size at a time")
    if args.plot and not (args.max_batch or args.max_seq):
        raise CliError("--plot draws the search of --max-batch or --max-seq")
    try:
        model, config = meta_model(
            args.model, overrides, dtype="float32" if mixed else args.dtype or "bfloat16"
        )
        training_batch(config, args.seq, args.batch)  # bad sizes refused before any work
    except ModelSpecError as exc:
        raise CliError(str(exc)) from None

    def graph_at(seq: int, batch: int):
        inputs, loss_fn = training_batch(config, seq, batch)
        return profile(
            model,
            inputs,
            loss_fn,
            fake=True,
            hardware=args.hardware,
            optimizer=args.optimizer,
            foreach={"auto": None, "on": True, "off": False}[args.foreach],
            # FSDP2 reduce-scatters the gradients into shards: counted beside, not in backward
            gradients="held" if sharded else args.gradients,
            precision=args.precision,
            name=f"{config.model_type}-s{seq}-b{batch}",
        )

    if args.max_batch or args.max_seq:
        return _largest(args, config, graph_at)
    if pipelined:
        return _pipelined(args, graph_at)
    with _Spinner("profiling (fake)"):
        g = graph_at(args.seq, args.batch)
    print(g.summary())
    with _Spinner("planning"):
        report = fit(
            g,
            _fit_hardware(args),
            time_limit_s=args.time_limit,
            solver=args.solver,
            host_memory_bytes=args.host_memory,
            ranks=args.ranks,
            **({"memory_bytes": args.memory} if args.memory else {}),
        )
    print(report.table())
    if args.out:  # the graph the plan was made for: one rank's, with its collectives
        Path(args.out).write_text(rank_graph(g, args.ranks).to_json(indent=1))
        print(f"wrote {args.out}")
    if args.plan:
        if report.plan is None:
            raise CliError(f"--plan {args.plan}: no plan fits, nothing written")
        Path(args.plan).write_text(report.plan.to_json(indent=1))
        print(f"wrote {args.plan}")
    return 0


def _largest(args, config, graph_at) -> int:
    """--max-batch / --max-seq: the search, the strategies at its answer, the plot."""
    import sys

    from .cli_errors import CliError
    from .fit_search import largest_fit
    from .plot import plot_throughput

    if args.max_batch:
        dimension, at, per = "batch", (lambda n: graph_at(args.seq, n)), args.seq
        limit = 1 << 16
    else:
        dimension, at, per = "seq", (lambda n: graph_at(n, args.batch)), args.batch
        positions = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        limit = int(positions) if positions else 1 << 20
    found = largest_fit(
        at,
        _fit_hardware(args),
        dimension=dimension,
        limit=limit,
        tokens_per_size=per,
        memory_bytes=args.memory or None,
        host_memory_bytes=args.host_memory,
        ranks=args.ranks,
        solver=args.solver,
        time_limit_s=args.time_limit,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        curve=bool(args.plot),
    )
    if found.report is not None:
        print(found.report.table())
    print(found.table())
    if args.out:
        Path(args.out).write_text(json.dumps(found.to_dict(), indent=1))
        print(f"wrote {args.out}")
    if args.plan:
        if found.report is None or found.report.plan is None:
            raise CliError(f"--plan {args.plan}: no plan fits, nothing written")
        Path(args.plan).write_text(found.report.plan.to_json(indent=1))
        print(f"wrote {args.plan}")
    if args.plot:
        for path in plot_throughput(found.curve, args.plot, dimension):
            print(f"wrote {path}")
    return 0


def _pipelined(args, graph_at) -> int:
    """``--pipeline-stages``: the whole model's step split into stages, each fit under the
    schedule (fit_stages.py)."""
    from .cli import _Spinner
    from .cli_errors import CliError
    from .fit_stages import fit_stages

    with _Spinner("profiling (fake)"):
        g = graph_at(args.seq, args.batch)
    print(g.summary())
    with _Spinner("planning every stage"):
        try:
            report = fit_stages(
                g,
                _fit_hardware(args),
                stages=args.pipeline_stages,
                micro_batches=args.micro_batches,
                schedule=args.schedule,
                stages_per_rank=args.stages_per_rank,
                solver=args.solver,
                time_limit_s=args.time_limit,
                **({"memory_bytes": args.memory} if args.memory else {}),
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
    print(report.table())
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(g.to_json(indent=1))
        print(f"wrote {args.out}")
    return 0
