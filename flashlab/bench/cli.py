"""The command line: ``python -m flashlab.bench --help`` explains every flag.

Every flag is checked before anything runs: a bad value, a combination the sweep cannot run, or an ``--out`` that
cannot be written stops the command with one line naming the problem and exit status 2. Results already on disk
are never replaced without ``--overwrite``: an ``--out`` whose files exist is refused, and a run without ``--out``
whose default name is taken (a second run the same day) writes ``NAME-2``, ``NAME-3``, ...
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from flashlab.bench import ladder_results as ladder
from flashlab.bench.args import MAX_SEED, finite_number, name_list, output_prefix, size_list, whole_number
from flashlab.bench.config import BenchConfig
from flashlab.bench.grid import CAUSAL_CHOICES, DTYPES
from flashlab.bench.implementations import BACKENDS, DEFAULT_BACKENDS
from flashlab.bench.results import (
    BenchResults,
    default_folder,
    default_prefix,
    folder_problem,
    output_problem,
    summary_table,
)
from flashlab.bench.sweep import run_sweep

# ----------------------------------------------------------------------------------------------------------------
# Command line


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (what is wrong and where to look), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


POSITIVE = whole_number(1)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m flashlab.bench",
        description=__doc__.split("\n\n")[0]
        + " Each (backend, cell) is checked against a float64 reference before it is timed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Defaults marked None depend on the device and mode: on a GPU, prefill runs bf16, D 64,128, N 1k..16k "
        "with 16k tokens per batch and a 2048-wide model (H = 2048 / D), so every cell does the same work per token as "
        "a layer of a 2048-wide model and fills the GPU (warmup 25, rep 100); decode runs bf16, D 128, "
        "KV 1k,4k,32k,128k, batches 1,8, 64 query / 8 KV heads (a Llama-70B-like GQA layer); on the CPU or with "
        "--quick, tiny grids.",
    )
    p.add_argument(
        "--mode",
        choices=[
            "prefill",
            "decode",
            "backward",
            "traffic",
            "context-parallel",
            "loops",
            "coldstart",
            "step",
            "varlen",
        ],
        default="prefill",
        help="prefill: N queries attend to N keys; decode: one query token per sequence against a KV cache of N "
        "tokens, grouped-query heads (--q-heads / --kv-heads), batches from --batches; backward: the prefill grid, "
        "timing dq, dk, dv from dO (FLOPs 2.5x the forward's), gradients checked against float64 autograd first, "
        "peak memory of forward + backward recorded; traffic: HBM and L2 bytes per kernel from Nsight Compute's "
        "counters (its own flags: --mode traffic --help); context-parallel: ring against all-gather attention and "
        "one GPU, forward + backward, one process per GPU under torchrun (its own flags: --mode context-parallel "
        "--help); loops: whole loops of calls as a user runs them (a growing decode cache, chunked prefill with a new "
        "shape every call, paged decode with default arguments) beside the loops they should cost no more than (its "
        "own flags: --mode loops --help); coldstart: the first call of 40 assorted shapes in a fresh process with an "
        "empty Triton cache (its own flags: --mode coldstart --help); step: one training step of a 12-layer GPT with "
        "each attention in turn, tokens/s beside the Amdahl prediction from attention's share of the step (its own "
        "flags: --mode step --help); varlen: a packed batch of sequences of different "
        "lengths through flash_attention_varlen, beside padding, a loop per sequence, torch's varlen_attn and SDPA "
        "FLASH, forward and forward + backward (its own flags: --mode varlen --help)",
    )
    p.add_argument(
        "--seq-lens",
        type=size_list,
        help="sequence lengths N, comma-separated ('2k' = 2048); in decode, KV cache lengths",
    )
    p.add_argument("--head-dims", type=size_list, help="head dims D, comma-separated")
    p.add_argument("--dtypes", type=name_list, help=f"dtypes, comma-separated, from {sorted(DTYPES)}")
    p.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), default="both", help="causal mask: yes, no or both")
    p.add_argument(
        "--backends",
        type=name_list,
        help=f"backends to run, comma-separated, from {','.join(BACKENDS)} (default: {','.join(DEFAULT_BACKENDS)}; "
        "the flashlab_<rung> backends time each rung of flashlab's kernel ladder and run when named)",
    )
    p.add_argument("--tokens", type=POSITIVE, help="prefill: tokens per batch B*N; batch B = tokens // N (at least 1)")
    p.add_argument("--model-dim", type=POSITIVE, help="prefill: model width H*D; heads H = model_dim // D (at least 1)")
    p.add_argument(
        "--gqa",
        type=POSITIVE,
        default=1,
        help="prefill and backward: query heads per key/value head (grouped-query attention; default 1)",
    )
    p.add_argument("--batches", type=size_list, help="decode: batch sizes, comma-separated (default 1,8 on a GPU)")
    p.add_argument("--q-heads", type=POSITIVE, help="decode: query heads (default 64 on a GPU)")
    p.add_argument("--kv-heads", type=POSITIVE, help="decode: key/value heads, dividing --q-heads (default 8 on a GPU)")
    p.add_argument(
        "--kv-dtype",
        choices=["fp8"],
        help="decode: also run each paged backend on an 8-bit (float8 e4m3) cache, one scale per sequence and K/V "
        "head, beside the 16-bit one (paged16_fp8, paged256_fp8), checked against float64 of the dequantised cache "
        "(16-bit queries: the dtype defaults to bf16)",
    )
    p.add_argument("--warmup", type=finite_number(0.0), help="warm-up time per measurement, ms (do_bench's warmup)")
    p.add_argument(
        "--rep",
        type=finite_number(0.0, above=True),
        help="timed repetitions per measurement, ms (do_bench's rep); median reported",
    )
    p.add_argument(
        "--rounds",
        type=POSITIVE,
        help="prefill and decode: time the backends of a cell in this many rounds, sharing --rep, the order "
        "turning by one each round; the median round is reported (default 3 on a GPU, 1 on the CPU)",
    )
    p.add_argument(
        "--out",
        type=output_prefix,
        help="write PREFIX.csv and PREFIX.json, refused if they exist unless --overwrite (default: "
        "data/results/<gpu>-<dtypes>-<date> on a GPU, test-artifacts/bench/cpu-<dtypes>-<date> on the CPU; a name "
        "taken already gets -2, -3, ...)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the files of an --out that exist")
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="a tiny grid that finishes in seconds (smoke test)")
    p.add_argument(
        "--no-ceilings", action="store_true", help="skip measuring copy bandwidth and matmul TFLOP/s (GPU only)"
    )
    p.add_argument("--check-rows", type=POSITIVE, default=256, help="query rows per head checked against float64")
    p.add_argument(
        "--max-memory-gb",
        type=finite_number(0.0, above=True),
        help="memory (GB) a materialising backend may assume free when pre-checking its score matrix "
        "(default: what the device reports free)",
    )
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0, help="random seed for q, k, v")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    study = p.add_argument_group("studying flashlab's prefill kernel (default: the kernel's own choices)")
    study.add_argument(
        "--kernel-config",
        type=size_list,
        help="BLOCK_M,BLOCK_N,num_warps,num_stages: one fixed tile config instead of the autotuner's pick",
    )
    study.add_argument(
        "--tile-order", choices=["forward", "reverse"], help="order of the query tiles (reverse: causal default)"
    )
    study.add_argument("--tma", choices=["on", "off"], help="tensor-memory-accelerator tile loads (Hopper) on or off")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` a parsed command line asks for (unresolved: device defaults still to fill in)."""
    return BenchConfig(
        seq_lens=args.seq_lens,
        head_dims=args.head_dims,
        dtypes=args.dtypes,
        causal=args.causal,
        backends=args.backends,
        mode=args.mode,
        batches=args.batches,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        kv_dtype=args.kv_dtype,
        tokens=args.tokens,
        model_dim=args.model_dim,
        gqa=args.gqa,
        warmup=args.warmup,
        rep=args.rep,
        rounds=args.rounds,
        device=args.device,
        quick=args.quick,
        ceilings=not args.no_ceilings,
        check_rows=args.check_rows,
        max_memory_gb=args.max_memory_gb,
        seed=args.seed,
        kernel_config=tuple(args.kernel_config) if args.kernel_config else None,
        tile_order=args.tile_order,
        tma=args.tma,
    )


def main(argv: Sequence[str] | None = None) -> BenchResults:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = OneLineParser(prog="python -m flashlab.bench", add_help=False)
    mode.add_argument("--mode")
    if mode.parse_known_args(argv)[0].mode == "traffic":  # measured bytes: its own flags (--mode traffic --help)
        from flashlab.bench.traffic import main as traffic_main

        return traffic_main(argv)
    if mode.parse_known_args(argv)[0].mode == "context-parallel":  # one process per GPU: its own flags
        from flashlab.bench.context_parallel import main as context_parallel_main

        rest = mode.parse_known_args(argv)[1]  # every flag but --mode
        return context_parallel_main(rest)
    if mode.parse_known_args(argv)[0].mode == "loops":  # whole loops of calls: its own flags
        from flashlab.bench.loops import main as loops_main

        return loops_main(argv)
    if mode.parse_known_args(argv)[0].mode == "coldstart":  # first calls in a fresh process: its own flags
        from flashlab.bench.coldstart import main as coldstart_main

        return coldstart_main(argv)
    if mode.parse_known_args(argv)[0].mode == "step":  # one training step of a whole model: its own flags
        from flashlab.bench.train_step import main as step_main

        return step_main(argv)
    if mode.parse_known_args(argv)[0].mode == "varlen":  # packed sequences of different lengths: its own flags
        from flashlab.bench.varlen import main as varlen_main

        return varlen_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    decode = args.mode == "decode"
    for flag in ("--tokens", "--model-dim") if decode else ("--batches", "--q-heads", "--kv-heads", "--kv-dtype"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:  # a flag the grid would ignore
            grid = "--mode decode (it takes --batches, --q-heads, --kv-heads)" if decode else "--mode decode only"
            parser.error(f"{flag} is not for {grid}" if decode else f"{flag} is for {grid}")
    config = config_from_args(args)
    try:  # every check of the configuration, before anything runs
        resolved = config.resolve()
    except ValueError as e:
        parser.error(str(e))
    if args.out:
        problem = output_problem(args.out, args.overwrite)
    else:
        problem = folder_problem(default_folder(resolved.device == "cuda"))
    if problem:
        parser.error(f"--out {args.out}: {problem}" if args.out else f"{problem} (or pass --out)")
    results = run_sweep(
        config, progress=not args.no_progress, command=shlex.join(["python", "-m", "flashlab.bench", *argv])
    )
    json_path, csv_path = results.save(args.out or default_prefix(results.meta), overwrite=args.overwrite)
    print(summary_table(results))
    for line in ladder.step_lines(results):  # the kernel ladder's steps, when the sweep ran two rungs or more
        print(line)
    print(f"wrote {json_path} and {csv_path}")
    return results
