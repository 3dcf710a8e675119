"""What produced a set of numbers: the device, the versions of everything that ran, and the date."""

from __future__ import annotations

import datetime
import os
import platform

import torch

from flashlab import __version__


def environment_stamp(device: str) -> dict:
    """What produced the numbers: device, versions, date."""
    import triton

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name = props.name
        extra = dict(
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gb=round(props.total_memory / 1e9, 1),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        extra = {}
    return dict(
        tool="flashlab.bench",
        flashlab=__version__,
        device=device,
        device_name=device_name,
        is_cuda_gpu=device == "cuda",
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda if device == "cuda" else None,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **extra,
    )
