"""Where a first call's seconds go: a few of ``flashlab.bench.coldstart.CALLS`` made once each under cProfile, in a
process whose Triton cache starts empty (run with TRITON_CACHE_DIR pointing at an empty folder).

    TRITON_CACHE_DIR=$(mktemp -d) python lab/probes/first_call_profile.py OUT_DIR 0 1 25 10 29
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from flashlab.bench import coldstart

WATCH = ("compile", "make_launcher", "_build", "subprocess.py", "run", "reproduces", "build", "warmup", "ptxas",
         "make_cubin", "make_ptx", "make_llir", "make_ttgir", "make_ttir")  # fmt: skip


def main(out: Path, indices):
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in indices:
        call = coldstart.CALLS[i]
        q, k, v = coldstart._inputs(call, "cuda", i)
        run = coldstart._make_call(call, q, k, v, i)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        run()
        torch.cuda.synchronize()
        prof.disable()
        total = time.perf_counter() - t0
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        stats.print_stats(45)
        text = f"=== {i} {call.name}: {total:.2f} s\n" + s.getvalue()
        (out / f"profile-{i:02d}.txt").write_text(text)
        # the stages of Triton's compiler, summed
        per = {}
        for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
            if func in ("make_ttir", "make_ttgir", "make_llir", "make_ptx", "make_cubin", "compile", "make_launcher",
                        "reproduces", "_build", "build") or "ptxas" in func:  # fmt: skip
                per[f"{Path(file).name}:{func}"] = per.get(f"{Path(file).name}:{func}", 0) + ct
        summary = f"{i:2d} {call.name:36s} {total:6.2f} s  " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.05
        )
        print(summary, flush=True)
        lines.append(summary)
        (out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(x) for x in sys.argv[2:]])
